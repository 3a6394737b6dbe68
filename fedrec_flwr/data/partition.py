"""Per-user partitions: built once per dataset, cached as CSR arrays, read one slice at a time.

A virtual client memory-maps the cache and copies only its own rows, so loading costs
time proportional to the user's own data, not to the dataset. The cache is written to a
temporary folder and renamed into place, so an interrupted build leaves nothing behind
that a later run would read.

This is also where FedGNN's ratings enter reference units (`RatingScale.to_units`): the cache, the
per-node files and the catalogue hold the dataset's own ratings and public scale, and what a
participant is handed (`UserPartitions.user`, `UserPartitions.meta`, `data.node_files.load_user_file`) is
mapped onto [1, 5]. Mapping on read, in one place, keeps every stored format unchanged and every
consumer (device, server, attacks, benchmarks) on the same units without each knowing about the map.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .types import DataError, RatingDataset, Ratings, RatingScale

FORMAT_VERSION = 1
_ARRAYS = ("train_offsets", "train_items", "train_values", "test_offsets", "test_items", "test_values")


@dataclass
class UserData:
    """One user's own ratings: what a FedGNN client holds."""

    user: int
    train_items: np.ndarray
    train_values: np.ndarray
    test_items: np.ndarray
    test_values: np.ndarray
    # the public catalogue's item features [num_items, F] (one shared array, not per user), or None
    item_features: np.ndarray | None = None


@dataclass(frozen=True)
class PartitionMeta:
    """What the server and every client may know about the dataset: sizes and scale, no ratings.

    `scale` is the scale participants work in, FedGNN's reference units ([1, 5]; the dataset's own
    scale on 1-5 datasets), and `public_scale` the dataset's own. Stored forms (meta.json, user files,
    the catalogue) keep the dataset's own scale under "scale": `public_facts` / `from_public_facts`.
    """

    dataset: str
    num_users: int
    num_items: int
    scale: RatingScale
    num_train: int
    num_test: int
    fingerprint: str
    num_item_features: int = 0  # F of the public item features the model takes (0: none)
    public_scale: RatingScale | None = None  # the dataset's own rating scale (None: `scale` itself)

    @property
    def dataset_scale(self) -> RatingScale:
        """The dataset's own (public) rating scale, on which its stored ratings and reported metrics lie."""
        return self.public_scale if self.public_scale is not None else self.scale

    def public_facts(self) -> dict:
        """The stored form: these facts with the dataset's own scale under "scale" (no unit-mapped fields)."""
        facts = asdict(self)
        del facts["public_scale"]
        facts["scale"] = asdict(self.dataset_scale)
        return facts

    @classmethod
    def from_public_facts(cls, raw: dict) -> "PartitionMeta":
        """A participant's view of stored facts: `scale` in reference units, `public_scale` the stored one."""
        raw = dict(raw)
        public = raw["scale"] if isinstance(raw["scale"], RatingScale) else RatingScale(**raw["scale"])
        return cls(**{**raw, "scale": public.in_units(), "public_scale": public})


def in_units(data: UserData, scale: RatingScale) -> UserData:
    """A user's ratings on the dataset's `scale` as a device reads them: in reference units (unchanged on 1-5)."""
    if scale.is_reference:
        return data
    return replace(data, train_values=scale.to_units(data.train_values), test_values=scale.to_units(data.test_values))


class CSR(NamedTuple):
    """Per-user compressed rows: user u's entries are items[offsets[u]:offsets[u + 1]]."""

    offsets: np.ndarray
    items: np.ndarray
    values: np.ndarray


def _csr(num_users: int, part: Ratings) -> CSR:
    order = np.lexsort((part.items, part.users))
    counts = np.bincount(part.users, minlength=num_users)
    offsets = np.zeros(num_users + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return CSR(offsets, part.items[order].astype(np.int32), part.values[order].astype(np.float32))


def fingerprint(parts: dict) -> str:
    """Stable short hash of whatever identifies a dataset build (name, config, the files' sha256)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_partitions(ds: RatingDataset, directory: Path, key: str) -> Path:
    """Write `ds` as per-user CSR arrays under `directory`, atomically (tmp folder + rename)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.part-"))
    try:
        tr = _csr(ds.num_users, ds.train)
        te = _csr(ds.num_users, ds.test)
        for name, arr in zip(_ARRAYS, (*tr, *te)):
            np.save(tmp / f"{name}.npy", arr)
        num_features = 0
        if ds.item_features is not None:
            np.save(tmp / "item_features.npy", ds.item_features.astype(np.float32))
            num_features = int(ds.item_features.shape[1])
        meta = PartitionMeta(ds.name, ds.num_users, ds.num_items, ds.scale, len(ds.train), len(ds.test), key,
                             num_features)
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT_VERSION, **meta.public_facts()}, indent=1))
        if directory.exists():  # a concurrent builder won the race: keep its identical copy
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def discard(directory: Path) -> None:
    """Remove a cache folder: first renamed aside (atomic), so no reader sees it half deleted."""
    trash = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.trash-"))
    try:
        os.replace(directory, trash / directory.name)
    except FileNotFoundError:
        pass  # another process discarded it first
    shutil.rmtree(trash, ignore_errors=True)


def _check_csr(meta: PartitionMeta, arrays: dict[str, np.ndarray], part: str, rows: int) -> None:
    offsets, items, values = (arrays[f"{part}_{n}"] for n in ("offsets", "items", "values"))
    if offsets.shape != (meta.num_users + 1,) or items.shape != (rows,) or values.shape != (rows,):
        raise ValueError(f"{part} arrays of shapes {offsets.shape}, {items.shape}, {values.shape}; "
                         f"expected ({meta.num_users + 1},), ({rows},), ({rows},)")
    if offsets[0] != 0 or offsets[-1] != rows or (np.diff(offsets) < 0).any():
        raise ValueError(f"{part}_offsets do not run from 0 up to {rows}")


class UserPartitions:
    """Read access to a partition cache; each `user(u)` call touches only that user's rows."""

    def __init__(self, directory: Path):
        meta_path = directory / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"partition cache {directory}: missing meta.json (expected a built cache); delete the "
                            f"folder to rebuild")
        try:
            raw = json.loads(meta_path.read_text())
            fmt = raw.pop("format", None)
            if fmt != FORMAT_VERSION:
                raise ValueError(f"format {fmt} (expected {FORMAT_VERSION})")
            self.meta = PartitionMeta.from_public_facts(raw)  # the participants' view: scale in reference units
            self._arrays = {n: np.load(directory / f"{n}.npy", mmap_mode="r") for n in _ARRAYS}
            _check_csr(self.meta, self._arrays, "train", self.meta.num_train)
            _check_csr(self.meta, self._arrays, "test", self.meta.num_test)
            # public and small (items x F): every client holds all of it
            self.item_features = np.load(directory / "item_features.npy") if self.meta.num_item_features else None
            if self.item_features is not None and self.item_features.shape != (self.meta.num_items,
                                                                               self.meta.num_item_features):
                raise ValueError(f"item_features.npy of shape {self.item_features.shape}")
        except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(f"partition cache {directory} is damaged ({type(exc).__name__}: {exc}); "
                            "delete the folder to rebuild it") from None
        self.directory = directory

    def ratings(self) -> RatingDataset:
        """The whole split as one RatingDataset (for centralized baselines; clients never call it)."""
        a = self._arrays

        def part(name: str) -> Ratings:
            counts = np.diff(np.asarray(a[f"{name}_offsets"]))
            users = np.repeat(np.arange(self.meta.num_users, dtype=np.int64), counts)
            return Ratings(users, np.asarray(a[f"{name}_items"], np.int64), np.asarray(a[f"{name}_values"], np.float32))

        m = self.meta
        return RatingDataset(m.dataset, m.num_users, m.num_items, m.dataset_scale, part("train"), part("test"))

    def user(self, u: int) -> UserData:
        """The train and test ratings of user `u` in reference units (`in_units`): what a device trains on."""
        return in_units(self.stored_user(u), self.meta.dataset_scale)

    def stored_user(self, u: int) -> UserData:
        """The train and test ratings of user `u` on the dataset's own scale, copied out of the memory map."""
        if not 0 <= u < self.meta.num_users:
            raise DataError(f"user {u} out of range [0, {self.meta.num_users}) for dataset {self.meta.dataset}")
        a = self._arrays
        s, e = int(a["train_offsets"][u]), int(a["train_offsets"][u + 1])
        ts, te = int(a["test_offsets"][u]), int(a["test_offsets"][u + 1])
        return UserData(
            u,
            np.array(a["train_items"][s:e], dtype=np.int64),
            np.array(a["train_values"][s:e]),
            np.array(a["test_items"][ts:te], dtype=np.int64),
            np.array(a["test_values"][ts:te]),
            self.item_features,
        )
