"""Drive FedGNN users and the server core in one process, without Flower or Ray.

Used for fast hyper-parameter sweeps and device (GPU) checks: the same user and server code
as a `flwr run` (`clients.fedgnn_user`, `strategies.fedgnn_server`), minus message transport.
Imports neither flwr nor ray. User sampling uses the same seeded rule as the strategy.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import torch

from benchmarks.run import input_errors_exit
from clients.fedgnn_user import FedGNNUser, MemoryStore
from fedrec_flwr.config import load_config, parse_overrides
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.models import build_model
from strategies.fedgnn_server import FedGNNServer, sample_users


def run_direct(cfg, device: torch.device | None = None, log_every: int = 5, server_device: torch.device | None = None,
               probe: Callable[[FedGNNServer, Callable[[np.ndarray | None], float]], dict] | None = None) -> dict:
    """Run cfg.federation.rounds FedGNN rounds in-process; returns final metrics and timings.

    `probe(server, rmse)`, if given, runs at every evaluation and its dict joins that round's record;
    `rmse(table)` is the RMSE of all users evaluating against another item table (None: the server's).
    """
    if cfg.expansion.mode != "none":
        raise ValueError("benchmarks.direct drives training rounds only; run graph expansion through flwr run")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    server = FedGNNServer(cfg, meta.num_items, meta.scale.midpoint, server_device, meta.num_item_features)
    store = MemoryStore()
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)  # one device-side model, shared by users in turn
    users = [u for u in range(meta.num_users) if parts.user(u).train_items.size]
    for u in users:
        server.register(u, FedGNNUser(cfg, meta, parts.user(u), store, device, model).register())
    history, t_start = [], time.time()
    for rnd in range(2, cfg.federation.rounds + 2):
        t0 = time.time()
        chosen = sample_users(cfg.seed, rnd, users, cfg.federation.clients_per_round)
        weights = server.model_weights()
        updates = []
        for u in chosen:
            upload = FedGNNUser(cfg, meta, parts.user(u), store, device, model).train(weights, server.rows_for(u), rnd, {})
            updates.append(server.validate(u, upload))
        server.apply(updates)
        rec = {"round": rnd - 1, "round_seconds": time.time() - t0, "clients": len(updates)}
        if (rnd - 1) % cfg.federation.eval_every == 0 or rnd - 1 == cfg.federation.rounds:
            weights = server.model_weights()

            def rmse(table: np.ndarray | None = None) -> float:
                sse = n = 0.0
                for u in users:
                    rows = server.rows_for(u) if table is None else table[server.registry[u]]
                    s, _, k = FedGNNUser(cfg, meta, parts.user(u), store, device, model).evaluate(weights, rows)
                    sse, n = sse + s, n + k
                return float(np.sqrt(sse / n))

            rec["rmse"] = rmse()
            if probe is not None:
                rec.update(probe(server, rmse))
            if log_every:
                print(f"[direct] round {rec['round']} rmse {rec['rmse']:.4f} ({rec['round_seconds']:.2f}s/round)", flush=True)
        history.append(rec)
    train_secs = [h["round_seconds"] for h in history]
    return {"rmse": history[-1].get("rmse"), "median_round_seconds": float(np.median(train_secs)),
            "clients_per_second": cfg.federation.clients_per_round / float(np.median(train_secs)),
            "wall_seconds": time.time() - t_start, "history": history}


def main() -> None:
    """CLI: python -m benchmarks.direct --preset fedgnn --dataset synthetic --set key=value ..."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="fedgnn")
    ap.add_argument("--dataset", default="synthetic")
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--set", nargs="*", default=[])
    args = ap.parse_args()
    torch.set_num_threads(1)
    with input_errors_exit():
        overrides = [f"data.data_dir={args.data_dir}", *parse_overrides(" ".join(args.set))]
        cfg = load_config(args.preset, args.dataset, overrides)
        out = run_direct(cfg, torch.device(args.device))
    out.pop("history")
    print(out)


if __name__ == "__main__":
    main()
