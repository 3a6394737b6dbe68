"""Per-node data files and the public catalogue of a deployment, read (`fedrec_flwr.deployment.node_data` writes them).

A SuperNode reads only its own `user-<u>.npz` or `domain-<k>.npz`; the ServerApp reads `catalogue.json`,
the public facts of the dataset and no ratings. Every file is checked as it is read: a missing or
malformed one raises NodeDataError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .partition import PartitionMeta, UserData, in_units
from .types import Domain

CATALOGUE = "catalogue.json"


class NodeDataError(ValueError):
    """A node data file or catalogue that is missing or malformed; the message names the file."""


def _open(path: Path, kind: str):
    if not path.is_file():
        raise NodeDataError(f"node data-path {path}: no such file (expected a {kind} file written by "
                            f"fedrec_flwr.deployment.node_data)")
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
            raise NodeDataError(f"node data-path {path}: item_features {got}, expected shape {want} (the catalogue's "
                                f"public item features)")
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
        missing = {"index", "name", "num_items", "train_users", "train_items", "test_users",
                   "test_items"} - set(z.files)
        if missing:
            raise NodeDataError(f"node data-path {path}: missing arrays {sorted(missing)}")
        dom = Domain(str(z["name"]), int(z["num_items"]), z["train_users"].astype(np.int64),
                     z["train_items"].astype(np.int64), z["test_users"].astype(np.int64),
                     z["test_items"].astype(np.int64))
        return int(z["index"]), dom


def load_catalogue(path: Path | str) -> dict:
    """The public dataset facts the ServerApp needs in deployment (no ratings)."""
    path = Path(path)
    if not path.is_file():
        raise NodeDataError(f"data.catalogue {path}: no such file (write it with python -m "
                            f"fedrec_flwr.deployment.node_data)")
    try:
        cat = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise NodeDataError(f"data.catalogue {path}: not JSON ({exc})") from exc
    if cat.get("algorithm") == "fedgnn":
        cat["meta"] = _meta_from_json(json.dumps({k: v for k, v in cat.items() if k != "algorithm"}), str(path))
    elif cat.get("algorithm") != "fppdm":
        raise NodeDataError(f"data.catalogue {path}: 'algorithm' must be 'fedgnn' or 'fppdm'")
    return cat
