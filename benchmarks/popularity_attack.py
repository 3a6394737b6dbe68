"""Can the server pick a user's real items out of its anonymity set by popularity alone?

    python -m benchmarks.popularity_attack --data-dir DATA [--datasets ml-100k douban] [--preset fedgnn_tuned]

For each dataset and pseudo-item sampler (`uniform`: the paper's M pseudo items uniformly among the
unrated items; `popularity`: matched to the users' LDP popularity reports per stratum) the users
register through the same round core as `flwr run` (`fedrec_flwr.fedgnn.rounds`, in-process). The
server then ranks every received set by (a) how many received sets hold each item, which it always
knows, and (b) the true training popularity, which a stronger server may have from public data.
Reported: mean per-user AUC (0.5 is chance), top-10 precision against the base rate (the real
share of a set), and the mean set size (rows per upload: the traffic). Writes
benchmarks/results/popularity_attack.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.direct import register_users
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.registry import UserRegistry
from fedrec_flwr.fedgnn.rounds import FedGNNRounds
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.user import DeviceConfig, FedGNNUser, MemoryStore, own_items
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.privacy.attacks import popularity_attack

SAMPLERS = ("uniform", "popularity")


def measure(cfg) -> dict:
    """Register every user of cfg's dataset through the round core and attack the sets the server holds."""
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint, num_item_features=meta.num_item_features)
    rounds = FedGNNRounds.from_config(cfg, server, UserRegistry(meta.num_users, block_size=1), meta.scale.high - meta.scale.low)
    store = MemoryStore()
    users = [u for u in range(meta.num_users) if parts.user(u).train_items.size]
    device_cfg = DeviceConfig.from_config(cfg)
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)  # one device model, shared in turn
    register_users(rounds, users, lambda u: FedGNNUser(device_cfg, meta, parts.user(u), store, model=model))
    own = {u: own_items(parts.user(u)) for u in users}
    train_popularity = np.zeros(meta.num_items)
    for u in users:
        train_popularity[parts.user(u).train_items] += 1
    sets = dict(server.registry)
    out = {"users": len(users), "items": meta.num_items, "mean_set_size": float(np.mean([s.size for s in sets.values()])),
           "rejected": len(rounds.rejections)}
    for name, scores in (("observed set counts", None), ("true training popularity", train_popularity)):
        out[name] = popularity_attack(sets, own, scores)._asdict()
    return out


def main() -> None:
    """Measure every (dataset, sampler) and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--preset", default="fedgnn_tuned")
    ap.add_argument("--out", default="benchmarks/results/popularity_attack.json")
    args = ap.parse_args()
    results = {}
    for dataset in args.datasets:
        for sampler in SAMPLERS:
            cfg = load_config(args.preset, dataset, [f"data.data_dir={args.data_dir}", f"privacy.pseudo_sampler={sampler}"])
            t0 = time.time()
            r = measure(cfg)
            results[f"{dataset}/{sampler}"] = {"dataset": dataset, "sampler": sampler, **r,
                                               "settings": {k: getattr(cfg.privacy, k) for k in (
                                                   "pseudo_items", "pseudo_ratio", "popularity_bins", "popularity_epsilon")}}
            obs, true = r["observed set counts"], r["true training popularity"]
            print(f"{dataset:8s} {sampler:10s} set {r['mean_set_size']:7.1f} rows | AUC observed {obs['auc']:.3f} "
                  f"true {true['auc']:.3f} | top-10 {obs['top_precision']:.2f}/{true['top_precision']:.2f} "
                  f"base {obs['base_rate']:.2f} ({time.time() - t0:.0f}s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "date": time.strftime("%Y-%m-%d"),
                                          "results": results}, indent=1))


if __name__ == "__main__":
    main()
