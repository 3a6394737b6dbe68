"""Readers for the on-disk formats: delimited rating files and MATLAB v7.3 (HDF5) matrices.

Every reader checks what it reads and raises DataError naming the file, the line or
key, and what was expected, instead of producing silently wrong arrays.

Duplicates are refused, not merged: a (user, item) pair may appear once in a file, and a split's
test file may not repeat a pair of its training file (`check_disjoint`). None of the published
files has one (ML-100K u1.base/u1.test, the GA-DTCDR Douban domains and the DisenCDR Amazon pairs were
checked; MovieLens ratings.dat holds one rating per user and movie, and a .mat matrix has one cell
per pair), so a duplicate means an edited or concatenated file, and any merge rule (first, last, mean)
would silently train and score on another split than the published one.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .types import DataError

# the largest id (and matrix dimension) accepted: partition caches store ids as int32, and every
# real dataset stays far below it, so anything larger is a corrupt or hostile file
MAX_ID = 2**31 - 1


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise DataError(f"missing file {path}")


def read_delimited(
    path: Path, sep: str | None, min_cols: int, value_col: int | None = 2, id_low: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read `user<sep>item<sep>value...` lines into (users, items, values) as raw ids.

    `sep=None` splits on any whitespace. Lines must be UTF-8 with at least `min_cols` fields,
    integer ids in [id_low, MAX_ID] and (when `value_col` is set) a finite numeric value; blank
    lines are skipped.
    """
    _require_file(path)
    users: list[int] = []
    items: list[int] = []
    values: list[float] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                stripped = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                                f"{exc.start + 1})") from None
            if not stripped:
                continue
            fields = stripped.split(sep)
            if len(fields) < min_cols:
                raise DataError(
                    f"{path}:{lineno}: expected at least {min_cols} fields separated by "
                    f"{sep or 'whitespace'!r}, got {len(fields)}: {stripped[:80]!r}"
                )
            try:
                user, item = int(fields[0]), int(fields[1])
                value = float(fields[value_col]) if value_col is not None else 1.0
            except ValueError:
                raise DataError(
                    f"{path}:{lineno}: expected integer user and item ids"
                    + (" and a numeric rating" if value_col is not None else "")
                    + f", got {stripped[:80]!r}"
                ) from None
            for name, ident in (("user", user), ("item", item)):
                if not id_low <= ident <= MAX_ID:
                    raise DataError(f"{path}:{lineno}: {name} id {ident} out of range (expected {id_low} <= "
                                    f"id <= {MAX_ID})")
            if not math.isfinite(value):
                raise DataError(f"{path}:{lineno}: rating {fields[value_col]!r} is not a finite number")
            users.append(user)
            items.append(item)
            values.append(value)
    if not users:
        raise DataError(f"{path}: empty file (expected rating lines)")
    out = (np.asarray(users, np.int64), np.asarray(items, np.int64), np.asarray(values, np.float32))
    _check_unique_pairs(path, out[0], out[1])
    return out


def _pair_keys(users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """One int64 per (user, item) pair of raw ids in [0, MAX_ID] (below 2**62, so no overflow)."""
    return users.astype(np.int64) * (MAX_ID + 1) + items.astype(np.int64)


def _line_of(path: Path, entry: int) -> int:
    """The line number of the `entry`-th (0-based) non-blank line of `path` (only called to name an error)."""
    seen = -1
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if raw.decode("utf-8", "replace").strip():  # the lines read_delimited reads
                seen += 1
                if seen == entry:
                    return lineno
    return -1


def _check_unique_pairs(path: Path, users: np.ndarray, items: np.ndarray) -> None:
    """DataError naming the first line of `path` that repeats an earlier line's (user, item) pair."""
    keys = _pair_keys(users, items)
    order = np.argsort(keys, kind="stable")
    repeats = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if not repeats.size:
        return
    second = int(order[repeats + 1].min())  # the earliest entry that repeats a pair seen before it
    first = int(np.flatnonzero(keys == keys[second])[0])
    raise DataError(f"{path}:{_line_of(path, second)}: user {users[second]} and item {items[second]} again (first on "
                    f"line {_line_of(path, first)}); expected each (user, item) pair once (duplicates are refused, "
                    "not merged: the published splits have none)")


def check_disjoint(train_path: Path, train_users: np.ndarray, train_items: np.ndarray, test_path: Path,
                   test_users: np.ndarray, test_items: np.ndarray) -> None:
    """DataError naming the first line of the test file whose (user, item) pair the training file also holds."""
    train_keys, test_keys = _pair_keys(train_users, train_items), _pair_keys(test_users, test_items)
    both = np.flatnonzero(np.isin(test_keys, train_keys))
    if not both.size:
        return
    k = int(both[0])
    j = int(np.flatnonzero(train_keys == test_keys[k])[0])
    raise DataError(f"{test_path}:{_line_of(test_path, k)}: user {test_users[k]} and item {test_items[k]} are also in "
                    f"the training file ({train_path}:{_line_of(train_path, j)}); expected disjoint train and test "
                    "splits (a test rating the model trained on)")


def _read_matrix(path: Path, key: str, node) -> np.ndarray:
    import h5py
    import scipy.sparse as sp

    if isinstance(node, h5py.Group):
        if not {"data", "ir", "jc"} <= set(node.keys()):
            raise DataError(f"{path}: key '{key}' is a group without sparse data/ir/jc")
        try:
            matrix = sp.csc_matrix((node["data"][()], node["ir"][()], node["jc"][()]))
            matrix.check_format(full_check=True)  # out-of-range indices would corrupt memory on densify
        except (TypeError, ValueError) as exc:
            raise DataError(f"{path}: key '{key}' holds inconsistent sparse data/ir/jc arrays: {exc}") from None
        shape = matrix.shape
    else:
        shape = node.shape
    if len(shape) != 2 or max(shape) > MAX_ID:
        raise DataError(f"{path}: key '{key}' has shape {shape}; expected a 2-D matrix with sides <= {MAX_ID}")
    try:
        dense = matrix.T.toarray() if isinstance(node, h5py.Group) else np.asarray(node[()], np.float64).T
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: key '{key}' is not a numeric matrix: {exc}") from None
    return np.asarray(dense, np.float64)


def read_mat_v73(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Read dense or sparse matrices from a MATLAB v7.3 file, transposed to row-major (users x items)."""
    import h5py

    _require_file(path)
    try:
        fh = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{path}: not a MATLAB v7.3 (HDF5) file: {exc}") from exc
    out: dict[str, np.ndarray] = {}
    with fh:
        for key in keys:
            if key not in fh:
                raise DataError(f"{path}: missing key '{key}' (expected keys {list(keys)}, found {sorted(fh.keys())})")
            try:
                out[key] = _read_matrix(path, key, fh[key])
            except OSError as exc:  # a truncated or damaged HDF5 file fails on the read
                raise DataError(f"{path}: cannot read key '{key}': {exc}") from None
    shapes = {k: v.shape for k, v in out.items()}
    if len(set(shapes.values())) != 1:
        raise DataError(f"{path}: keys {list(keys)} must share one shape, got {shapes}")
    return out
