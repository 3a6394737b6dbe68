"""A FedGNN user's round against its arithmetic floor: each primitive the round needs, timed alone at the
preset's sizes, beside the real path (`fedrec_flwr.fedgnn.local_step.train_users`) on the same users.

    python -m benchmarks.roofline --data-dir DATA [--dataset ml-100k] [--preset fedgnn_tuned]
        [--users 128] [--repeats 5] [--devices cpu cuda] [--out benchmarks/results/roofline-<preset>-<dataset>.json]

One round's sample of `--users` users (seeded), registered with the preset's sampler, on the untrained
model. Primitives, per user (milliseconds, median of `--repeats`, one torch thread):
- `noise`: the Laplace draws of the whole upload (model gradients + anonymity-set rows) with the generator
  the devices use (`standard_laplace`, a float32 exponential and a sign bit, over ChaCha20 keyed by a device
  secret); beside it, for reference, the same draws from numpy's seeded PCG64 (what they cost before device
  secrets; not secure), numpy's float64 `laplace` and a difference of two float32 exponentials;
- `clip`: clipping the upload and adding the noise (`privatize_flat`'s arithmetic);
- `pseudo`: the pseudo rows' draw (`pseudo_gradient_rows`: Ledoit-Wolf fit and the Gaussian draw, from the
  device's ChaCha20 stream);
- `gnn`: the GNN's forward and backward on the padded star graphs of the user's batch group, as many
  times as a local step runs them (`local.steps` with all gradients, `user_steps - 1` for the embedding
  alone), on prebuilt tensors.
The floor is their sum; the real path is `train_users` on the same users with the preset's user_batch
(local steps, protection, state kept), divided by the users. Writes JSON; prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_data_dir, markdown_table
from fedrec_flwr.config import load_config, parse_overrides
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.local_step import _pad, size_groups, train_users
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore, popularity_report, set_weights
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.models.dense_star import DenseStars, dense_predict, per_user_copies
from fedrec_flwr.models.rating_gnn import row_width
from fedrec_flwr.privacy import pseudo_gradient_rows
from fedrec_flwr.privacy.device_secret import DeviceSecret
from fedrec_flwr.privacy.ldp import standard_laplace
from fedrec_flwr.privacy.popularity import estimate_counts


def _each(fn, items) -> None:
    """fn on every item, keeping no result alive (as the real path frees each user's upload)."""
    for item in items:
        fn(*item)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def sample_users(cfg, users: int, device: torch.device):
    """`users` seeded users of the dataset, registered with the preset's sampler, and the server's model."""
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint,
                                      num_item_features=meta.num_item_features)
    device_cfg = DeviceSections.from_config(cfg)
    popularity = None
    if cfg.privacy.pseudo_sampler == "popularity":
        reports = [popularity_report(device_cfg, meta, parts.user(u)) for u in range(meta.num_users)]
        popularity = estimate_counts(np.sum(reports, axis=0), len(reports), cfg.privacy.popularity_epsilon)
    picked = np.sort(np.random.default_rng([cfg.seed, 77]).choice(meta.num_users, min(users, meta.num_users),
                                                                  replace=False))
    store = MemoryStore()
    model = None
    devices = []
    for u in picked:
        dev = FedGNNUser(device_cfg, meta, parts.user(int(u)), store, device, model)
        model = dev.model  # one device-side model shared by the node's users, as a simulated node has
        server.register(int(u), dev.register(popularity))
        devices.append(dev)
    return server, devices


def primitives(cfg, server, devices, device: torch.device, repeats: int) -> dict[str, float]:
    """Per-user milliseconds of each primitive (module docstring), summed over the users and divided by them."""
    users = len(devices)
    weights = server.model_weights()
    model = devices[0].model
    set_weights(model, weights)
    model.to(device).train(True)
    w = row_width(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    sizes = [params + dev.state.anonymity_ids.size * w for dev in devices]
    rng = DeviceSecret.fresh().generator(0, 0)  # the devices' own generator: ChaCha20 keyed by a device secret
    seeded = np.random.default_rng(0)  # numpy's PCG64, what seeded draws cost (not secure: for comparison only)
    out = {
        "noise": _median_ms(lambda: _each(lambda n: standard_laplace(rng, n), [(n,) for n in sizes]), repeats) / users,
        "noise_seeded_pcg64": _median_ms(lambda: _each(lambda n: standard_laplace(seeded, n), [(n,) for n in sizes]),
                                         repeats) / users,
        "noise_numpy_laplace_f64": _median_ms(lambda: _each(lambda n: rng.laplace(0, 1, n), [(n,) for n in sizes]),
                                              repeats) / users,
        "noise_two_exponentials_f32": _median_ms(lambda: _each(
            lambda n: rng.standard_exponential((2, n), dtype=np.float32), [(n,) for n in sizes]), repeats) / users,
    }
    payloads = [torch.randn(n, device=device) for n in sizes]
    noises = [torch.from_numpy(standard_laplace(rng, n)).to(device) for n in sizes]
    lam, delta = cfg.privacy.noise_lambda, cfg.privacy.clip_delta

    def clip():
        for x, e in zip(payloads, noises):
            x.clamp_(-delta, delta).add_(e, alpha=lam)
        if device.type == "cuda":
            torch.cuda.synchronize()

    out["clip"] = _median_ms(clip, repeats) / users
    reals = [torch.randn(dev.data.train_items.size, w, device=device) * 0.1 for dev in devices]
    counts = [dev.state.anonymity_ids.size - dev.data.train_items.size for dev in devices]
    out["pseudo"] = _median_ms(lambda: _each(lambda r, c: pseudo_gradient_rows(rng, r, c), list(zip(reals, counts))),
                               repeats) / users
    out["gnn"] = gnn_ms(cfg, model, devices, device, repeats) / users
    out["floor"] = out["noise"] + out["clip"] + out["pseudo"] + out["gnn"]
    out["upload_coordinates"] = float(np.mean(sizes))
    return out


def gnn_ms(cfg, model, devices, device: torch.device, repeats: int) -> float:
    """Milliseconds for the GNN forward/backward passes of every group's local step, on prebuilt padded tensors."""
    d, w = cfg.model.dim, row_width(cfg.model)
    active = sorted((k for k, dev in enumerate(devices) if dev.data.train_items.size),
                    key=lambda k: devices[k].data.train_items.size)
    groups = size_groups(active, [dev.data.train_items.size for dev in devices], cfg.simulation.user_batch)
    built = []
    for group in groups:
        rows = [np.random.default_rng(k).standard_normal((devices[k].data.train_items.size, w)).astype(np.float32) * 0.1
                for k in group]
        items, mask = _pad(rows, max(r.shape[0] for r in rows), w, device)
        neighbours = [devices[k].state.neighbours for k in group]
        neigh, nmask = _pad(neighbours, max(n.shape[0] for n in neighbours), d, device)
        user = torch.randn(len(group), d, device=device) * 0.1
        targets = torch.randn(mask.shape, device=device)
        built.append((items, mask, neigh, nmask, user, targets, len(group)))

    def run():
        for items, mask, neigh, nmask, user, targets, b in built:
            params = per_user_copies(model, b)
            leaves = list(params.values())
            items = items.detach().requires_grad_(True)
            user = user.detach().requires_grad_(True)
            x_items, b_items = (items[..., :d], items[..., d]) if cfg.model.item_bias else (items, None)
            g = DenseStars(user, x_items, neigh, mask, nmask)
            for _ in range(cfg.local.steps):
                loss = ((dense_predict(model, params, g, g, b_items) - targets) ** 2 * mask).sum()
                torch.autograd.grad(loss, [*leaves, items, user])
            for _ in range(cfg.local.user_steps - 1):
                loss = ((dense_predict(model, params, g, g, b_items) - targets) ** 2 * mask).sum()
                torch.autograd.grad(loss, [user])
        if device.type == "cuda":
            torch.cuda.synchronize()

    return _median_ms(run, repeats)


def real_path_ms(cfg, server, devices, device: torch.device, repeats: int) -> float:
    """Per-user milliseconds of `train_users` (local steps, protection, state kept) on the sampled users."""
    weights = server.model_weights()
    rows = [server.rows_for(dev.user) for dev in devices]
    rnd = iter(range(2, 10**6))

    def run():
        train_users(devices, weights, rows, next(rnd), None, cfg.simulation.user_batch)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return _median_ms(run, repeats) / len(devices)


def main(argv: list[str] | None = None) -> None:
    """Measure the primitives and the real path on each device; write the JSON record and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--dataset", default="ml-100k")
    ap.add_argument("--preset", default="fedgnn_tuned")
    ap.add_argument("--users", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(args.preset, args.dataset,
                      [f"data.data_dir={args.data_dir}", *parse_overrides(" ".join(args.set))])
    rows = {}
    for name in args.devices:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            rows[name] = {"skipped": "torch sees no CUDA device"}
            continue
        server, devices = sample_users(cfg, args.users, device)
        row = primitives(cfg, server, devices, device, args.repeats)
        row["real_path"] = real_path_ms(cfg, server, devices, device, args.repeats)
        row["real_over_floor"] = row["real_path"] / row["floor"]
        rows[name] = row
        print(f"[roofline] {args.preset} {args.dataset} {name}: "
              + json.dumps({k: round(v, 3) for k, v in row.items()}),
              flush=True)
    doc = {"date": date.today().isoformat(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "preset": args.preset,
           "dataset": args.dataset, "users": args.users, "user_batch": cfg.simulation.user_batch,
           "repeats": args.repeats, "devices": rows}
    out = Path(args.out or f"benchmarks/results/roofline-{args.preset}-{args.dataset}.json")
    atomic_write(out, json.dumps(doc, indent=1))
    measured = {k: v for k, v in rows.items() if "skipped" not in v}
    print(markdown_table(["device", "noise", "clip", "pseudo rows", "GNN fwd+bwd", "floor", "real path",
                          "real / floor"],
                         [[k, v["noise"], v["clip"], v["pseudo"], v["gnn"], v["floor"], v["real_path"],
                           v["real_over_floor"]] for k, v in measured.items()]))


if __name__ == "__main__":
    main()
