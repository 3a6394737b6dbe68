"""Where one FedGNN user's training time goes: local gradients (torch) against upload protection (numpy).

    python -m benchmarks.fedgnn_user_split [--users 100] [--device cpu]

On ML-10M-shaped synthetic data (10,677 items, ~180 ratings per user), paper preset, privacy on:
times `local_gradients` (GNN forward/backward on the star graph) and `build_upload` (pseudo rows,
L-inf clipping, Laplace noise) for each user and reports their medians and shares. Explains why a
GPU does not speed up FedGNN clients (BENCHMARKS.md, GPU section). Writes
benchmarks/results/fedgnn_user_split.json.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu_clients import ML10M_SHAPE
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.user import (
    DeviceSections,
    FedGNNUser,
    MemoryStore,
    build_upload,
    local_gradients,
    set_weights,
    user_rng,
)
from fedrec_flwr.fsutil import atomic_write


def split_times(users: int, device: torch.device, cache_dir: str) -> dict:
    """Median milliseconds per user of the gradient step and of building the protected upload."""
    cfg = load_config("fedgnn_paper", "synthetic", [f"data.cache_dir={cache_dir}", f"data.synthetic.num_users={users}", *ML10M_SHAPE])
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint, num_item_features=meta.num_item_features)
    store = MemoryStore()
    for u in range(users):
        server.register(u, FedGNNUser(DeviceSections.from_config(cfg), meta, parts.user(u), store).register())
    weights, grad_ms, upload_ms = server.model_weights(), [], []
    for u in range(users):
        user = FedGNNUser(DeviceSections.from_config(cfg), meta, parts.user(u), store, device)
        set_weights(user.model, weights)
        rng, rows = user_rng(cfg.seed, u, 1, 2), user.item_rows(server.rows_for(u))
        t0 = time.perf_counter()
        grads, real_rows, *_ = local_gradients(user.cfg, user.model, user.state, user.data, rows, rng, device)
        t1 = time.perf_counter()
        build_upload(user.cfg, user.state, user.data, grads, real_rows, rng)
        upload_ms.append((time.perf_counter() - t1) * 1e3)
        grad_ms.append((t1 - t0) * 1e3)
    g, up = float(np.median(grad_ms[1:])), float(np.median(upload_ms[1:]))  # the first user warms up
    return {"gradients_ms": g, "upload_ms": up, "upload_share": up / (g + up)}


def main() -> None:
    """Measure and record the split."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache-dir", default=".cache/fedrec")
    ap.add_argument("--out", default="benchmarks/results/fedgnn_user_split.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    row = split_times(args.users, torch.device(args.device), args.cache_dir)
    doc = {"date": date.today().isoformat(), "torch": torch.__version__, "device": args.device, "users": args.users, **row}
    atomic_write(Path(args.out), json.dumps(doc, indent=1))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
