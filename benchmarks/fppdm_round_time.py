"""Seconds of one FPPDM round at the paper's training settings (batch 256, 5 local epochs) on one dataset.

    OMP_NUM_THREADS=1 python -m benchmarks.fppdm_round_time --dataset amazon-phone-elec \
        --data-dir ../shared/data --repeats 3 [--threads 1] [--set fppdm.training.row_propagation=false] \
        [--steps-per-epoch 20]

One round is what `flwr run` does in a round, in one process and without Flower: every domain's
`fit` (local training from the round's starting model, then its users' (mu, sigma) upload) one
after another, then the server's per-user W2 barycenter. Each repeat rebuilds the domains from the
same seed, so every repeat does the same work. Reports every domain's seconds, their sum (the round
in one process) and their maximum (the round when each domain has its own core, as in a
simulation with one SuperNode per domain); writes them into benchmarks/results/fppdm_round_time.json under
"runs" -> "<dataset>/<preset>/threads=<n>[/<override>...]" (a rerun replaces its own entry only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_data_dir
from fedrec_flwr.config import load_config
from fedrec_flwr.data import load_multidomain
from fedrec_flwr.fppdm.barycenter import UserGaussians, user_barycenters
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer

PAPER = ["fppdm.training.batch_size=256", "fppdm.training.local_epochs=5"]


def one_round(cfg, ds, steps_per_epoch: int = 0, device: torch.device | None = None) -> dict:
    """Build every domain from the run seed and time round 1: each domain's training and upload, then the barycenter.

    device: where every domain trains (default CPU); the upload's copy back to the host ends its timing.

    steps_per_epoch > 0 trains each epoch on steps_per_epoch batches of a fixed random sample of every
    domain's interactions (to time a slow configuration); round_seconds is then the full round extrapolated
    from the measured seconds per step (measured_round_seconds: what the shortened round took).
    """
    f = cfg.fppdm
    trainers = [DomainTrainer(DomainData(dom), k, f.model, f.training, f.coclustering, cfg.seed, device)
                for k, dom in enumerate(ds.domains)]
    full_steps = {tr.data.name: f.training.local_epochs * -(-tr.data.users.size // f.training.batch_size)
                  for tr in trainers}
    if steps_per_epoch > 0:  # a fixed random sample of the interactions (the graph stays whole)
        for tr in trainers:
            keep = np.sort(np.random.default_rng(0).permutation(tr.data.users.size)[
                : steps_per_epoch * f.training.batch_size])
            tr.data.users, tr.data.items = tr.data.users[keep], tr.data.items[keep]
    empty = np.zeros(0, np.int64), np.zeros((0, f.model.dim), np.float32), np.zeros((0, f.model.dim), np.float32)
    seconds, uploads, losses = {}, [], {}
    for tr in trainers:
        t0 = time.perf_counter()
        losses[tr.data.name] = tr.train(1, *empty)
        mu, sigma = tr.user_distributions()
        uploads.append(UserGaussians(tr.data.global_ids.astype(np.int64), mu, sigma))
        seconds[tr.data.name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    user_barycenters(uploads, ds.num_users, f.model.dim)
    server = time.perf_counter() - t0
    steps = {tr.data.name: f.training.local_epochs * -(-tr.data.users.size // f.training.batch_size) for tr in trainers}
    record = {"domain_seconds": seconds, "server_seconds": server, "train_loss": losses, "steps": steps,
              "seconds_per_step": {k: seconds[k] / steps[k] for k in steps},
              "round_seconds": sum(seconds.values()) + server, "parallel_round_seconds": max(seconds.values()) + server}
    if steps_per_epoch > 0:  # the full round at the measured seconds per step (uploads included in them)
        full = {k: record["seconds_per_step"][k] * full_steps[k] for k in steps}
        record.update(full_steps=full_steps, measured_round_seconds=record["round_seconds"],
                      round_seconds=sum(full.values()) + server, parallel_round_seconds=max(full.values()) + server)
    return record


def main() -> None:
    """Time `--repeats` rounds, print them and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="amazon-phone-elec")
    add_data_dir(ap)
    ap.add_argument("--preset", default="fppdm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (and the propagation's threads)")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides, after the paper settings")
    ap.add_argument("--steps-per-epoch", type=int, default=0,
                    help="train only this many batches per epoch and extrapolate the round (0: whole epochs)")
    ap.add_argument("--out", default="benchmarks/results/fppdm_round_time.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    overrides = [f"data.data_dir={args.data_dir}", *PAPER, *args.set]
    cfg = load_config(args.preset, args.dataset, overrides)
    ds = load_multidomain(cfg.data)
    runs = []
    for r in range(args.repeats):
        runs.append(one_round(cfg, ds, args.steps_per_epoch))
        print(f"[fppdm_round_time] repeat {r + 1}/{args.repeats}: round {runs[-1]['round_seconds']:.1f} s "
              f"(domains {', '.join(f'{k} {v:.1f} s' for k, v in runs[-1]['domain_seconds'].items())})", flush=True)
    entry = {
        "command": "python -m benchmarks.fppdm_round_time " + " ".join(
            [f"--dataset {args.dataset}", f"--data-dir {args.data_dir}", f"--preset {args.preset}",
             f"--repeats {args.repeats}", f"--threads {args.threads}"]
            + ([f"--steps-per-epoch {args.steps_per_epoch}"] if args.steps_per_epoch else [])
            + ([f"--set {' '.join(args.set)}"] if args.set else [])),
        "extrapolated": bool(args.steps_per_epoch),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_threads": args.threads,
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch": torch.__version__},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dataset": args.dataset, "preset": args.preset, "overrides": overrides[1:],
        "training": {"batch_size": cfg.fppdm.training.batch_size, "local_epochs": cfg.fppdm.training.local_epochs,
                     "row_propagation": cfg.fppdm.training.row_propagation, "dim": cfg.fppdm.model.dim,
                     "layers": cfg.fppdm.model.layers},
        "repeats": runs,
        "median_round_seconds": statistics.median(r["round_seconds"] for r in runs),
        "median_parallel_round_seconds": statistics.median(r["parallel_round_seconds"] for r in runs),
    }
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {}
    key = (f"{args.dataset}/{args.preset}/threads={args.threads}" + "".join(f"/{s}" for s in args.set)
           + (f"/steps_per_epoch={args.steps_per_epoch}" if args.steps_per_epoch else ""))
    doc.setdefault("runs", {})[key] = entry  # one entry per (dataset, preset, threads, overrides): reruns replace it
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"[fppdm_round_time] median round {entry['median_round_seconds']:.1f} s "
          f"(domains in parallel: {entry['median_parallel_round_seconds']:.1f} s); wrote {out} [{key}]", flush=True)


if __name__ == "__main__":
    main()
