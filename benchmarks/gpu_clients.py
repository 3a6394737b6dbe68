"""Clients per second on CPU against GPU, driving the client and server code directly (no flwr, no ray).

    python -m benchmarks.gpu_clients [--devices cpu cuda] [--users 2000] [--rounds 4] [--data-dir DATA]

FedGNN: `fedrec_flwr.cli.inprocess.run_in_process` (FedGNNUser + FedGNNServer, paper preset, privacy on)
on synthetic data shaped like ML-10M (10,677 items, ~144 ratings per user), 128 users per
round; clients/s = users trained per second of round time (median over rounds after the
first). FPPDM: seconds per local epoch of one DomainTrainer on a synthetic domain (and the last
epoch's loss, which must not depend on the device beyond float rounding), and on the devices of
`--fppdm-round-devices` (default: cuda) one FPPDM round at the paper's settings (batch 256, 5 local
epochs; `benchmarks.fppdm_round_time.one_round`) on Amazon Phone-Elec where `--data-dir` holds it, else
on a synthetic pair of about its size (3,325 users, 30,000 items per domain).
Needs only torch, torch-geometric and the project's own pure-Python dependencies, so it runs
on a GPU machine without flwr or ray. A device that is not present is reported as skipped.
Writes benchmarks/results/gpu_clients.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from benchmarks.fppdm_round_time import PAPER, one_round
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import load_multidomain
from fedrec_flwr.data.synthetic import make_synthetic_multidomain
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer
from fedrec_flwr.fsutil import atomic_write

# synthetic data with ML-10M's catalogue and ratings per user
ML10M_SHAPE = ["data.synthetic.num_items=10677", "data.synthetic.mean_degree=180"]


def fedgnn_clients_per_second(device: torch.device, users: int, rounds: int, cache_dir: str,
                              overrides: list[str]) -> dict:
    """Median clients/s of FedGNN training rounds with users and server on `device`."""
    cfg = load_config("fedgnn_paper", "synthetic", [
        f"data.cache_dir={cache_dir}", f"data.synthetic.num_users={users}", *ML10M_SHAPE,
        f"federation.rounds={rounds}", f"federation.eval_every={rounds}",
        f"simulation.device_secrets={Path(cache_dir) / 'device-secrets'}", *overrides,  # CPU and CUDA: the same draws
    ])
    out = run_in_process(cfg, device, log_every=0, server_device=device)
    secs = [h["round_seconds"] for h in out["history"]][1:] or [out["median_round_seconds"]]
    return {"clients_per_second": cfg.federation.clients_per_round / float(np.median(secs)),
            "median_round_s": float(np.median(secs)), "rmse": out["rmse"]}


def fppdm_epoch_seconds(device: torch.device, users: int, items: int, epochs: int) -> dict:
    """Seconds per local epoch of one FPPDM domain (Gaussian LightGCN, D = 128, batch 256) on `device`."""
    ds = make_synthetic_multidomain(seed=0, num_domains=1, num_users=users, items_per_domain=items, mean_degree=30.0)
    cfg = load_config("fppdm", "synthetic-md3", ["fppdm.training.local_epochs=1"])
    f = cfg.fppdm
    trainer = DomainTrainer(DomainData(ds.domains[0]), 0, f.model, f.training, f.coclustering, cfg.seed, device)
    empty = np.zeros(0, np.int64), np.zeros((0, f.model.dim), np.float32), np.zeros((0, f.model.dim), np.float32)
    times, loss = [], 0.0
    for epoch in range(epochs + 1):  # the first epoch warms up kernels and allocators
        t0 = time.time()
        loss = trainer.train(epoch + 1, *empty)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.time() - t0)
    return {"epoch_s": float(np.median(times[1:])), "interactions": int(trainer.data.users.size), "loss": loss}


def fppdm_paper_round(device: torch.device, data_dir: str, users: int, items: int) -> dict:
    """Seconds of one FPPDM round at the paper's settings with every domain on `device`: Amazon Phone-Elec
    when `data_dir` holds it, else a synthetic pair of `users` users and `items` items per domain."""
    if (Path(data_dir) / "disencdr_amazon" / "phone_electronic" / "train.txt").is_file():
        cfg = load_config("fppdm", "amazon-phone-elec", [f"data.data_dir={data_dir}", *PAPER])
        ds, source = load_multidomain(cfg.data), "amazon-phone-elec"
    else:
        cfg = load_config("fppdm", "synthetic-md2", PAPER)
        ds = make_synthetic_multidomain(seed=0, num_domains=2, num_users=users, items_per_domain=items,
                                        mean_degree=25.0)
        source = f"synthetic pair, {users} users, {items} items per domain"
    record = one_round(cfg, ds, device=device)
    return {"data": source, "round_seconds": record["round_seconds"], "domain_seconds": record["domain_seconds"],
            "steps": record["steps"], "train_loss": record["train_loss"]}


def device_row(name: str, args: argparse.Namespace) -> dict:
    """FedGNN and FPPDM measured on device `name`, or {"skipped": why} when torch cannot see it."""
    if name == "cuda" and not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    device = torch.device(name)
    row = {"fedgnn": fedgnn_clients_per_second(device, args.users, args.rounds, args.cache_dir, args.set),
           "fppdm": fppdm_epoch_seconds(device, args.fppdm_users, args.fppdm_items, args.fppdm_epochs)}
    if name in args.fppdm_round_devices:
        row["fppdm_paper_round"] = fppdm_paper_round(device, args.data_dir, args.fppdm_round_users,
                                                     args.fppdm_round_items)
    if device.type == "cuda":
        row["gpu"] = torch.cuda.get_device_name(device)
    return row


def add_speedups(rows: dict[str, dict]) -> None:
    """Give every measured device but cpu its FedGNN clients/s and FPPDM epoch-time ratios against cpu."""
    cpu = rows.get("cpu", {})
    for name, row in rows.items():
        if name != "cpu" and "fedgnn" in row and "fedgnn" in cpu:
            row["fedgnn_speedup_vs_cpu"] = row["fedgnn"]["clients_per_second"] / cpu["fedgnn"]["clients_per_second"]
            row["fppdm_speedup_vs_cpu"] = cpu["fppdm"]["epoch_s"] / row["fppdm"]["epoch_s"]


def main() -> None:
    """Measure every available device; record ratios against CPU."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--fppdm-users", type=int, default=5000)
    ap.add_argument("--fppdm-items", type=int, default=3000)
    ap.add_argument("--fppdm-epochs", type=int, default=2)
    ap.add_argument("--fppdm-round-devices", nargs="*", default=["cuda"],
                    help="devices that also time one FPPDM round at the paper's settings (on CPU: minutes)")
    ap.add_argument("--fppdm-round-users", type=int, default=3325,
                    help="synthetic pair's users (without --data-dir data)")
    ap.add_argument("--fppdm-round-items", type=int, default=30000, help="synthetic pair's items per domain")
    ap.add_argument("--data-dir", default="data", help="folder holding the datasets (Amazon Phone-Elec, if there)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (a ClientApp gets one core)")
    ap.add_argument("--cache-dir", default=".cache/fedrec")
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--out", default="benchmarks/results/gpu_clients.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    for name in args.devices:
        rows[name] = device_row(name, args)
        print(f"[gpu_clients] {name}: {json.dumps(rows[name])}", flush=True)
    add_speedups(rows)
    doc = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "threads": args.threads, "users": args.users, "rounds": args.rounds,
           "overrides": args.set, "devices": rows}
    atomic_write(Path(args.out), json.dumps(doc, indent=1))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
