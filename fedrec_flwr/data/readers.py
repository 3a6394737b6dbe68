"""Readers for the on-disk formats: delimited rating files and MATLAB v7.3 (HDF5) matrices.

Every reader checks what it reads and raises DataError naming the file, the line or
key, and what was expected, instead of producing silently wrong arrays.
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
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})") from None
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
                    raise DataError(f"{path}:{lineno}: {name} id {ident} out of range (expected {id_low} <= id <= {MAX_ID})")
            if not math.isfinite(value):
                raise DataError(f"{path}:{lineno}: rating {fields[value_col]!r} is not a finite number")
            users.append(user)
            items.append(item)
            values.append(value)
    if not users:
        raise DataError(f"{path}: empty file (expected rating lines)")
    return (
        np.asarray(users, np.int64),
        np.asarray(items, np.int64),
        np.asarray(values, np.float32),
    )


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
