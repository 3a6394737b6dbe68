"""Data layer: registry of datasets, loaders, synthetic generators and per-user partitions."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

from ..fsutil import writable_folder, writing_into
from .download import sha256_of
from .holdout import validation_split
from .node_files import load_catalogue
from .partition import UserData, UserPartitions, discard, fingerprint, write_partitions
from .sources import AnyDataset, dataset_names, get_spec, load_dataset, resolve_root
from .sparse import sparse_variant
from .synthetic import synthetic_scale
from .types import (
    DataError,
    Domain,
    MultiDomainDataset,
    RatingDataset,
    Ratings,
    RatingScale,
)

log = logging.getLogger(__name__)

__all__ = [
    "AnyDataset", "DataError", "Domain", "MultiDomainDataset", "RatingDataset", "Ratings", "RatingScale",
    "UserData", "UserPartitions", "dataset_names", "load_from_config", "load_multidomain", "prepare_partitions",
    "public_scale",
]


def load_from_config(data_cfg) -> AnyDataset:
    """Load the dataset a DataConfig names: its sparse variant when `data.train_per_user` or `data.cold_fraction`
    asks for one, then its validation holdout when `data.holdout=validation`."""
    ds = load_dataset(
        data_cfg.name, data_cfg.data_dir, data_cfg.cache_dir, data_cfg.download, data_cfg.seed,
        asdict(data_cfg.synthetic), data_cfg.item_features,
    )
    if data_cfg.train_per_user or data_cfg.cold_fraction:
        if not isinstance(ds, RatingDataset):
            raise DataError(f"data.train_per_user / data.cold_fraction: dataset '{data_cfg.name}' is multi-domain; a "
                            "sparse variant is made of explicit ratings (FedGNN, centralized)")
        ds = sparse_variant(ds, data_cfg.train_per_user, data_cfg.cold_fraction, data_cfg.seed)
    if data_cfg.holdout == "test":
        return ds
    if not isinstance(ds, RatingDataset):
        raise DataError(f"data.holdout = {data_cfg.holdout!r}: dataset '{data_cfg.name}' is multi-domain; a validation "
                        "holdout is carved from explicit ratings (FedGNN, centralized); expected data.holdout=test")
    return validation_split(ds, data_cfg.validation_fraction, data_cfg.seed)


def load_multidomain(data_cfg) -> MultiDomainDataset:
    """Load a multi-domain dataset; DataError if the name is a single-domain one."""
    ds = load_from_config(data_cfg)
    if not isinstance(ds, MultiDomainDataset):
        raise DataError(f"dataset '{ds.name}' is not multi-domain; FPPDM needs domains sharing user ids")
    return ds


def _build_key(data_cfg) -> dict:
    # keeps the keys of caches built before the option
    features = {"item_features": True} if data_cfg.item_features else {}
    if data_cfg.holdout != "test":  # likewise: a test-holdout cache keeps its key
        features.update(holdout=data_cfg.holdout, validation_fraction=data_cfg.validation_fraction)
    if data_cfg.train_per_user or data_cfg.cold_fraction:  # and a full dataset's cache keeps its key
        features.update(train_per_user=data_cfg.train_per_user, cold_fraction=data_cfg.cold_fraction)
    if data_cfg.name.startswith("synthetic"):
        return {"name": data_cfg.name, "seed": data_cfg.seed, "synthetic": asdict(data_cfg.synthetic), **features}
    spec = get_spec(data_cfg.name)
    groups = [spec]  # the feature file is looked up on its own, as load_dataset does
    if data_cfg.item_features and spec.item_features:
        groups.append(replace(spec, files=(spec.item_features[0],)))
    digests = {}  # the files' contents, not their stats: an edit that keeps size and mtime still rebuilds
    for group in groups:
        root = resolve_root(group, Path(data_cfg.data_dir), Path(data_cfg.cache_dir), data_cfg.download)
        for f in group.files:
            digests[f.relpath] = sha256_of(root / f.relpath)
    return {"name": spec.name, "seed": data_cfg.seed, "sha256": digests, **features}


def prepare_partitions(data_cfg) -> Path:
    """Build (once) and return the per-user partition cache of a single-domain rating dataset."""
    key = fingerprint(_build_key(data_cfg))
    safe = data_cfg.name.replace(":", "_").replace("/", "_")
    directory = Path(data_cfg.cache_dir) / "partitions" / f"{safe}-{key}"
    if directory.exists():  # folders appear whole (tmp + rename), so only later damage makes one unreadable
        try:
            UserPartitions(directory)
            return directory
        except DataError as exc:  # damaged after it was built (files deleted, truncated, edited)
            log.warning("%s: rebuilding it", exc)
            discard(directory)
    t0 = time.time()
    log.info("building per-user partitions of %s into %s", data_cfg.name, directory)
    # a built cache is only read (a read-only cache folder serves it); building one needs a writable folder,
    # checked before the dataset is read
    writable_folder(directory.parent, "cache folder")
    ds = load_from_config(data_cfg)
    if not isinstance(ds, RatingDataset):
        raise DataError(f"dataset '{data_cfg.name}' is multi-domain; per-user rating partitions need a rating dataset")
    with writing_into(directory.parent, "cache folder", f"building the partitions of {data_cfg.name}"):
        write_partitions(ds, directory, key)
    log.info("partitions of %s ready: %d users, %d items, %d train / %d %s ratings (%.1fs)",
             ds.name, ds.num_users, ds.num_items, len(ds.train), len(ds.test), data_cfg.holdout, time.time() - t0)
    return directory


def public_scale(data_cfg) -> RatingScale:
    """The public rating scale of the dataset a DataConfig names, found without reading any rating: the
    catalogue's (deployment), `data.synthetic.scale` (synthetic) or the registry's. The FedGNN server
    reports metrics on it; every participant works in its reference units."""
    if data_cfg.catalogue:
        return load_catalogue(data_cfg.catalogue)["meta"].dataset_scale
    if data_cfg.name == "synthetic":
        return synthetic_scale(data_cfg.synthetic.scale)
    return get_spec(data_cfg.name).scale or RatingScale(1.0, 5.0, 1.0)
