"""Per-node data for deployment: each SuperNode gets only its own user's (or domain's) file.

    python -m fedrec_flwr.node_data --preset fedgnn_paper --dataset synthetic --out deploy/data [--users 0 1 2]

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
    Domain,
    UserData,
    UserPartitions,
    load_multidomain,
    prepare_partitions,
)
from fedrec_flwr.data.partition import PartitionMeta, in_units
from fedrec_flwr.fsutil import atomic_write

CATALOGUE = "catalogue.json"


class NodeDataError(ValueError):
    """A node data file or catalogue that is missing or malformed; the message names the file."""


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
        public = {} if d.item_features is None else {"item_features": d.item_features}  # the catalogue's, not the user's
        atomic_write(out / f"user-{u}.npz", _npz({
            "user": np.int64(u), "train_items": d.train_items, "train_values": d.train_values,
            "test_items": d.test_items, "test_values": d.test_values,
            "meta": np.array(json.dumps(meta.public_facts())), **public,
        }))
    cat = {"algorithm": "fedgnn", **meta.public_facts()}
    return atomic_write(out / CATALOGUE, json.dumps(cat, indent=1))


def _open(path: Path, kind: str):
    if not path.is_file():
        raise NodeDataError(f"node data-path {path}: no such file (expected a {kind} file written by fedrec_flwr.node_data)")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:
        raise NodeDataError(f"node data-path {path}: not a readable .npz file ({exc})") from exc


def _meta_from_json(text: str, source: str) -> PartitionMeta:
    try:
        return PartitionMeta.from_public_facts(json.loads(text))  # the participants' view: scale in reference units
    except Exception as exc:
        raise NodeDataError(f"{source}: not a FedGNN catalogue ({exc})") from exc


def load_user_file(path: Path | str) -> tuple[PartitionMeta, UserData]:
    """(dataset facts, the user's own ratings) from a `user-<u>.npz` file, as a device reads them: the
    ratings and the facts' `scale` in reference units (`data.partition.in_units`), as in simulation."""
    path = Path(path)
    with _open(path, "user") as z:
        missing = {"user", "train_items", "train_values", "test_items", "test_values", "meta"} - set(z.files)
        if missing:
            raise NodeDataError(f"node data-path {path}: missing arrays {sorted(missing)}")
        meta = _meta_from_json(str(z["meta"]), str(path))
        features = z["item_features"].astype(np.float32) if "item_features" in z.files else None
        want = (meta.num_items, meta.num_item_features)
        if meta.num_item_features and (features is None or features.shape != want):
            got = "none" if features is None else f"shape {features.shape}"
            raise NodeDataError(f"node data-path {path}: item_features {got}, expected shape {want} (the catalogue's public item features)")
        data = UserData(int(z["user"]), z["train_items"].astype(np.int64), z["train_values"].astype(np.float32),
                        z["test_items"].astype(np.int64), z["test_values"].astype(np.float32), features)
        data = in_units(data, meta.dataset_scale)
    if data.train_items.size and (data.train_items.max() >= meta.num_items or data.train_items.min() < 0):
        raise NodeDataError(f"node data-path {path}: item ids outside [0, {meta.num_items})")
    return meta, data


def load_domain_file(path: Path | str) -> tuple[int, Domain]:
    """(domain index, the domain's interactions) from a `domain-<k>.npz` file."""
    path = Path(path)
    with _open(path, "domain") as z:
        missing = {"index", "name", "num_items", "train_users", "train_items", "test_users", "test_items"} - set(z.files)
        if missing:
            raise NodeDataError(f"node data-path {path}: missing arrays {sorted(missing)}")
        dom = Domain(str(z["name"]), int(z["num_items"]), z["train_users"].astype(np.int64), z["train_items"].astype(np.int64),
                     z["test_users"].astype(np.int64), z["test_items"].astype(np.int64))
        return int(z["index"]), dom


def load_catalogue(path: Path | str) -> dict:
    """The public dataset facts the ServerApp needs in deployment (no ratings)."""
    path = Path(path)
    if not path.is_file():
        raise NodeDataError(f"data.catalogue {path}: no such file (write it with python -m fedrec_flwr.node_data)")
    try:
        cat = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise NodeDataError(f"data.catalogue {path}: not JSON ({exc})") from exc
    if cat.get("algorithm") == "fedgnn":
        cat["meta"] = _meta_from_json(json.dumps({k: v for k, v in cat.items() if k != "algorithm"}), str(path))
    elif cat.get("algorithm") != "fppdm":
        raise NodeDataError(f"data.catalogue {path}: 'algorithm' must be 'fedgnn' or 'fppdm'")
    return cat


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
    cfg = load_config(args.preset, args.dataset or None, [f"data.data_dir={args.data_dir}", f"data.cache_dir={args.cache_dir}", *args.set])
    print(export_nodes(cfg, Path(args.out), args.users))


if __name__ == "__main__":
    main()
