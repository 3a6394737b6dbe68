"""In-memory dataset types shared by loaders, partitions, clients and the centralized trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class DataError(ValueError):
    """Bad or missing input data; the message names the file, line or key and what was expected."""


# FedGNN's reference units: every rating scale is mapped onto [1, 5] (see RatingScale.to_units)
REFERENCE_LOW, REFERENCE_HIGH = 1.0, 5.0
REFERENCE_SPAN = REFERENCE_HIGH - REFERENCE_LOW


@dataclass(frozen=True)
class RatingScale:
    """The rating range of a dataset (min, max and step), used to clip predictions.

    It also owns the one map between a dataset's ratings and FedGNN's *reference units*: the affine
    r -> 1 + 4 (r - low) / (high - low) onto [1, 5]. FedGNN's tuned settings (upload clip, learning
    rates, the bias starting at the midpoint) assume ratings a few units apart, so devices and the
    server train in reference units on every dataset; the map reads only the public scale (no data, no
    privacy cost) and is the identity on 1-5 datasets, so their numbers stay bit-identical. Ratings enter
    reference units where a device reads them (`data.partition`: UserData and the scale a device is
    told), and metrics leave them where the server reports them (`fedgnn.rounds`, `centralized`).
    """

    low: float
    high: float
    step: float

    @property
    def midpoint(self) -> float:
        """Centre of the scale: a data-free starting value for the global bias."""
        return 0.5 * (self.low + self.high)

    @property
    def span(self) -> float:
        """high - low: the widest error a prediction on the scale can make (clips and bounds are sized by it)."""
        return self.high - self.low

    @property
    def is_reference(self) -> bool:
        """True when the scale's bounds are the reference units' [1, 5] (the map is then the identity)."""
        return self.low == REFERENCE_LOW and self.high == REFERENCE_HIGH

    @property
    def unit_factor(self) -> float:
        """Rating points per reference unit, (high - low) / 4: multiplies an RMSE or MAE in units back."""
        return 1.0 if self.is_reference else self.span / REFERENCE_SPAN

    def to_units(self, values: np.ndarray) -> np.ndarray:
        """Ratings on this scale mapped onto [1, 5] (same dtype; unchanged when the scale is 1-5)."""
        values = np.asarray(values)
        if self.is_reference:
            return values
        mapped = REFERENCE_LOW + (values.astype(np.float64) - self.low) / self.unit_factor
        return mapped.astype(values.dtype if np.issubdtype(values.dtype, np.floating) else np.float64)

    def from_units(self, values: np.ndarray) -> np.ndarray:
        """Reference-unit values mapped back onto this scale (the inverse of `to_units`)."""
        values = np.asarray(values)
        if self.is_reference:
            return values
        mapped = self.low + (values.astype(np.float64) - REFERENCE_LOW) * self.unit_factor
        return mapped.astype(values.dtype if np.issubdtype(values.dtype, np.floating) else np.float64)

    def in_units(self) -> "RatingScale":
        """This scale expressed in reference units: [1, 5] with the step mapped (itself on 1-5)."""
        if self.is_reference:
            return self
        return RatingScale(REFERENCE_LOW, REFERENCE_HIGH, self.step / self.unit_factor)


@dataclass
class Ratings:
    """Explicit ratings as parallel arrays with 0-based ids."""

    users: np.ndarray  # int64 [n]
    items: np.ndarray  # int64 [n]
    values: np.ndarray  # float32 [n]

    def __len__(self) -> int:
        return int(self.users.shape[0])

    @staticmethod
    def empty() -> "Ratings":
        """A ratings set with no entries."""
        return Ratings(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))


@dataclass
class RatingDataset:
    """A single-domain explicit-rating dataset with a fixed train/test split."""

    name: str
    num_users: int
    num_items: int
    scale: RatingScale
    train: Ratings
    test: Ratings
    meta: dict = field(default_factory=dict)
    # public item metadata as model input (data.item_features): float32 [num_items, F], or None
    item_features: np.ndarray | None = None

    def validate(self, source: str) -> "RatingDataset":
        """Check ids and values against the declared sizes and scale; raise DataError naming `source`."""
        if self.item_features is not None:
            f = self.item_features
            if f.ndim != 2 or f.shape[0] != self.num_items or f.shape[1] == 0:
                raise DataError(f"{source}: item features of shape {f.shape}, expected ({self.num_items}, F >= 1)")
            if not np.isfinite(f).all():
                raise DataError(f"{source}: item features contain NaN or Inf")
        for part_name, part in (("train", self.train), ("test", self.test)):
            if len(part) == 0 and part_name == "train":
                raise DataError(f"{source}: empty dataset (no training ratings)")
            if len(part) == 0:
                continue
            if part.users.min() < 0 or part.users.max() >= self.num_users:
                raise DataError(f"{source}: {part_name} user id out of range [0, {self.num_users})")
            if part.items.min() < 0 or part.items.max() >= self.num_items:
                raise DataError(f"{source}: {part_name} item id out of range [0, {self.num_items})")
            bad = (part.values < self.scale.low - 1e-6) | (part.values > self.scale.high + 1e-6)
            if bad.any():
                raise DataError(
                    f"{source}: {part_name} rating {part.values[bad][0]} outside the scale "
                    f"[{self.scale.low}, {self.scale.high}]"
                )
        return self


@dataclass
class Domain:
    """One domain of a multi-domain implicit dataset: positives per user and a leave-one-out test item."""

    name: str
    num_items: int
    train_users: np.ndarray  # int64 [n] global user ids
    train_items: np.ndarray  # int64 [n] domain-local item ids
    test_users: np.ndarray  # int64 [m] global user ids (one row per tested user)
    test_items: np.ndarray  # int64 [m]


@dataclass
class MultiDomainDataset:
    """Several domains whose users share one id space (FPPDM's cross-silo setting)."""

    name: str
    num_users: int
    domains: list[Domain]
    meta: dict = field(default_factory=dict)
