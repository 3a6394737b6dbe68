"""Drive FedGNN clients and the strategy's server logic in one process, without Flower's runtime.

Used for fast hyper-parameter sweeps and device (GPU) checks: the same client and strategy
code as a `flwr run`, minus message transport. Results are the same algorithm, not the same
numbers as a Flower run (client sampling uses the same seeds, but there is no registration
round and no node indirection).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from clients.fedgnn import FedGNNClient, init_user_state
from clients.user_store import MemoryStore
from fedrec_flwr.config import load_config, parse_overrides
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.protocol import PHASE_TRAIN
from strategies.fedgnn_merge import FedGNNStrategy, validate_upload


def run_direct(cfg, device: torch.device | None = None, log_every: int = 5) -> dict:
    """Run cfg.federation.rounds FedGNN rounds in-process; returns final metrics and timings."""
    if cfg.expansion.mode != "none":
        raise ValueError("benchmarks.direct drives training rounds only; run graph expansion through flwr run")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    strategy = FedGNNStrategy(cfg, meta.num_items, meta.scale.midpoint, recorder=None)
    store = MemoryStore()
    users = [u for u in range(meta.num_users) if parts.user(u).train_items.size]
    for u in users:
        st = init_user_state(cfg, meta, parts.user(u))
        store.save(u, st)
        strategy.state.registry[u] = st.anonymity_ids
    history, t_start = [], time.time()
    for rnd in range(2, cfg.federation.rounds + 2):
        t0 = time.time()
        rng = np.random.default_rng([cfg.seed, rnd])
        chosen = rng.choice(len(users), size=min(cfg.federation.clients_per_round, len(users)), replace=False)
        accepted = []
        for idx in chosen:
            u = users[idx]
            client = FedGNNClient(cfg, meta, parts.user(u), store, device)
            arrays, _, _ = client.fit(strategy._payload(u), {"phase": PHASE_TRAIN, "round": rnd})
            accepted.append(validate_upload(arrays, strategy.model_shapes, cfg.model.dim, meta.num_items,
                                            strategy._min_rows(), strategy.state.registry[u]))
        strategy._apply(accepted)
        rec = {"round": rnd - 1, "round_seconds": time.time() - t0, "clients": len(accepted)}
        if (rnd - 1) % cfg.federation.eval_every == 0 or rnd - 1 == cfg.federation.rounds:
            sse = n = 0.0
            for u in users:
                client = FedGNNClient(cfg, meta, parts.user(u), store, device)
                _, _, m = client.evaluate(strategy._payload(u), {})
                sse += m["sse"]
                n += m["n"]
            rec["rmse"] = float(np.sqrt(sse / n))
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
    overrides = [f"data.data_dir={args.data_dir}", *parse_overrides(" ".join(args.set))]
    cfg = load_config(args.preset, args.dataset, overrides)
    out = run_direct(cfg, torch.device(args.device))
    out.pop("history")
    print(out)


if __name__ == "__main__":
    main()
