"""Per-node data for deployment, written: each SuperNode gets only its own user's (or domain's) file
(`fedrec_flwr.data.node_files` reads them).

    python -m fedrec_flwr.deployment.node_data --preset fedgnn_paper --dataset synthetic --out deploy/data [--users 0 1
    2]

writes `user-<u>.npz` per user (FedGNN) or `domain-<k>.npz` per domain (FPPDM), plus
`catalogue.json`: the public facts the server needs (dataset name, user and item counts,
rating scale, domain names), and no ratings. A SuperNode is started with
`--node-config "data-path='.../user-7.npz'"`; the ServerApp gets `data.catalogue` instead of
the dataset.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np

from fedrec_flwr.config import AppConfig, load_config
from fedrec_flwr.data import (
    UserPartitions,
    load_multidomain,
    prepare_partitions,
)
from fedrec_flwr.data.node_files import CATALOGUE
from fedrec_flwr.fsutil import atomic_write


def _npz(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def export_nodes(cfg: AppConfig, out: Path, users: list[int] | None = None) -> Path:
    """Write the per-node files of cfg's algorithm and the catalogue; returns the catalogue path."""
    from fedrec_flwr.algorithms import get_algorithm

    out.mkdir(parents=True, exist_ok=True)
    return get_algorithm(cfg.algorithm).part("node_data")(cfg, out, users)


def export_domains(cfg: AppConfig, out: Path, users: list[int] | None = None) -> Path:
    """FPPDM: one `domain-<k>.npz` per domain and the catalogue (`users` does not apply)."""
    ds = load_multidomain(cfg.data)
    for k, d in enumerate(ds.domains):
        atomic_write(out / f"domain-{k}.npz", _npz({
            "index": np.int64(k), "name": np.array(d.name), "num_items": np.int64(d.num_items),
            "train_users": d.train_users, "train_items": d.train_items,
            "test_users": d.test_users, "test_items": d.test_items,
        }))
    cat = {"algorithm": "fppdm", "dataset": ds.name, "num_users": ds.num_users, "domains": [d.name for d in ds.domains]}
    return atomic_write(out / CATALOGUE, json.dumps(cat, indent=1))


def export_users(cfg: AppConfig, out: Path, users: list[int] | None = None) -> Path:
    """FedGNN: one `user-<u>.npz` per user (all, or `users`) and the catalogue."""
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    for u in users if users is not None else range(meta.num_users):
        d = parts.stored_user(u)  # the user's own ratings, on the dataset's scale (mapped when loaded)
        # the catalogue's, not the user's
        public = {} if d.item_features is None else {"item_features": d.item_features}
        atomic_write(out / f"user-{u}.npz", _npz({
            "user": np.int64(u), "train_items": d.train_items, "train_values": d.train_values,
            "test_items": d.test_items, "test_values": d.test_values,
            "meta": np.array(json.dumps(meta.public_facts())), **public,
        }))
    cat = {"algorithm": "fedgnn", **meta.public_facts()}
    return atomic_write(out / CATALOGUE, json.dumps(cat, indent=1))


def main() -> None:
    """CLI: export per-node files for a preset and dataset."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fedgnn_paper")
    ap.add_argument("--dataset", default="")
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--cache-dir", default=".cache/fedrec")
    ap.add_argument("--out", required=True)
    ap.add_argument("--users", nargs="*", type=int, help="only these users (FedGNN)")
    ap.add_argument("--set", nargs="*", default=[])
    args = ap.parse_args()
    cfg = load_config(args.preset, args.dataset or None,
                      [f"data.data_dir={args.data_dir}", f"data.cache_dir={args.cache_dir}", *args.set])
    print(export_nodes(cfg, Path(args.out), args.users))


if __name__ == "__main__":
    main()
