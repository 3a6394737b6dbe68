"""Readers for the on-disk formats: delimited rating files and MATLAB v7.3 (HDF5) matrices.

Every reader checks what it reads and raises DataError naming the file, the line or
key, and what was expected, instead of producing silently wrong arrays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .types import DataError


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise DataError(f"missing file {path}")


def read_delimited(
    path: Path, sep: str | None, min_cols: int, value_col: int | None = 2
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read `user<sep>item<sep>value...` lines into (users, items, values) as raw ids.

    `sep=None` splits on any whitespace. Lines must have at least `min_cols` fields, integer
    ids and (when `value_col` is set) a numeric value; blank lines are skipped.
    """
    _require_file(path)
    users: list[int] = []
    items: list[int] = []
    values: list[float] = []
    with path.open("r", encoding="utf-8", errors="strict") as fh:
        for lineno, line in enumerate(fh, start=1):
            stripped = line.strip()
            if not stripped:
                continue
            fields = stripped.split(sep)
            if len(fields) < min_cols:
                raise DataError(
                    f"{path}:{lineno}: expected at least {min_cols} fields separated by "
                    f"{sep or 'whitespace'!r}, got {len(fields)}: {stripped[:80]!r}"
                )
            try:
                users.append(int(fields[0]))
                items.append(int(fields[1]))
                values.append(float(fields[value_col]) if value_col is not None else 1.0)
            except ValueError:
                raise DataError(
                    f"{path}:{lineno}: expected integer user and item ids"
                    + (" and a numeric rating" if value_col is not None else "")
                    + f", got {stripped[:80]!r}"
                ) from None
    if not users:
        raise DataError(f"{path}: empty file (expected rating lines)")
    return (
        np.asarray(users, np.int64),
        np.asarray(items, np.int64),
        np.asarray(values, np.float32),
    )


def check_ids(path: Path, name: str, ids: np.ndarray, low: int, high: int | None = None) -> None:
    """Raise DataError if any id is below `low` (or above `high`), naming the file and column."""
    if ids.size and ids.min() < low:
        raise DataError(f"{path}: {name} id {int(ids.min())} out of range (expected >= {low})")
    if high is not None and ids.size and ids.max() > high:
        raise DataError(f"{path}: {name} id {int(ids.max())} out of range (expected <= {high})")


def read_mat_v73(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Read dense or sparse matrices from a MATLAB v7.3 file, transposed to row-major (users x items)."""
    import h5py
    import scipy.sparse as sp

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
            node = fh[key]
            if isinstance(node, h5py.Group):
                if not {"data", "ir", "jc"} <= set(node.keys()):
                    raise DataError(f"{path}: key '{key}' is a group without sparse data/ir/jc")
                out[key] = np.asarray(
                    sp.csc_matrix((node["data"][()], node["ir"][()], node["jc"][()])).T.todense()
                )
            else:
                out[key] = np.asarray(node[()]).T
    shapes = {k: v.shape for k, v in out.items()}
    if len(set(shapes.values())) != 1:
        raise DataError(f"{path}: keys {list(keys)} must share one shape, got {shapes}")
    return out
