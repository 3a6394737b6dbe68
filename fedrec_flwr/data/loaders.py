"""Loaders from the real file formats to RatingDataset / MultiDomainDataset."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from .readers import check_disjoint, read_delimited, read_mat_v73
from .types import (
    DataError,
    Domain,
    MultiDomainDataset,
    RatingDataset,
    Ratings,
    RatingScale,
)


class Compacted(NamedTuple):
    """Raw ids mapped to 0..n-1: the train and test ids, and the raw id of each compact id."""

    train: np.ndarray
    test: np.ndarray
    raw: np.ndarray


def _compact(train_raw: np.ndarray, test_raw: np.ndarray) -> Compacted:
    """Map raw ids (any integers) to 0..n-1 over the union of train and test; also the raw id of each."""
    uniq, inv = np.unique(np.concatenate([train_raw, test_raw]), return_inverse=True)
    return Compacted(inv[: train_raw.size].astype(np.int64), inv[train_raw.size :].astype(np.int64), uniq)


def _check_scale(path: Path, values: np.ndarray, scale: RatingScale) -> None:
    bad = (values < scale.low) | (values > scale.high) | (
        np.abs(np.round((values - scale.low) / scale.step) * scale.step + scale.low - values) > 1e-4)
    if bad.any():
        idx = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{path}: rating {values[idx]} (entry {idx + 1}) is not on the scale "
            f"{scale.low}..{scale.high} step {scale.step}"
        )


def load_split_files(name: str, train_path: Path, test_path: Path, sep: str | None,
                     scale: RatingScale) -> RatingDataset:
    """A dataset from a given train file and test file of `user sep item sep rating ...` lines."""
    tr_u, tr_i, tr_r = read_delimited(train_path, sep, 3)
    te_u, te_i, te_r = read_delimited(test_path, sep, 3)
    for path, r in ((train_path, tr_r), (test_path, te_r)):
        _check_scale(path, r, scale)
    check_disjoint(train_path, tr_u, tr_i, test_path, te_u, te_i)
    tr_u, te_u, raw_users = _compact(tr_u, te_u)
    tr_i, te_i, raw_items = _compact(tr_i, te_i)
    return RatingDataset(
        name, raw_users.size, raw_items.size, scale, Ratings(tr_u, tr_i, tr_r), Ratings(te_u, te_i, te_r),
        meta={"train_file": str(train_path), "test_file": str(test_path), "raw_item_ids": raw_items},
    ).validate(str(train_path))


def load_movielens_genres(path: Path, raw_item_ids: np.ndarray) -> np.ndarray:
    """ML-100K's public genre flags (`u.item`: id|title|date|video date|url|19 flags) as item features.

    Row i belongs to the item whose raw id is `raw_item_ids[i]`; each row is the multi-hot
    genre vector scaled to sum 1, so a movie's feature input has the same size whatever its
    number of genres. Every rated item must have a line (DataError naming the file otherwise).
    """
    if not path.is_file():
        raise DataError(f"missing file {path} (data.item_features needs the MovieLens item catalogue u.item)")
    flags: dict[int, np.ndarray] = {}
    with path.open("r", encoding="latin-1") as fh:  # titles are latin-1 in the GroupLens release
        for lineno, line in enumerate(fh, start=1):
            stripped = line.rstrip("\r\n")
            if not stripped.strip():
                continue
            fields = stripped.split("|")
            if len(fields) != 24:
                raise DataError(f"{path}:{lineno}: expected 24 '|'-separated fields (id, title, dates, url, 19 genre "
                                f"flags), got {len(fields)}")
            try:
                item, row = int(fields[0]), np.array([int(x) for x in fields[5:]], np.float32)
            except ValueError:
                raise DataError(f"{path}:{lineno}: expected an integer id and 19 genre flags 0/1, got "
                                f"{stripped[:80]!r}") from None
            if not set(np.unique(row)) <= {0.0, 1.0}:
                raise DataError(f"{path}:{lineno}: genre flags must be 0 or 1, got {fields[5:]}")
            flags[item] = row
    missing = [int(i) for i in raw_item_ids if int(i) not in flags]
    if missing:
        raise DataError(f"{path}: no line for {len(missing)} rated item(s), e.g. id {missing[0]}")
    out = np.stack([flags[int(i)] for i in raw_item_ids])
    return out / np.maximum(out.sum(1, keepdims=True), 1.0)


def load_ratings_dat(name: str, path: Path, scale: RatingScale, seed: int = 1234,
                     test_fraction: float = 0.1) -> RatingDataset:
    """MovieLens-1M/10M `user::item::rating::ts` with GC-MC's random split (permutation under `seed`)."""
    users, items, values = read_delimited(path, "::", 3)
    _check_scale(path, values, scale)
    users, _, raw_users = _compact(users, users[:0])
    items, _, raw_items = _compact(items, items[:0])
    n_users, n_items = raw_users.size, raw_items.size
    perm = np.random.RandomState(seed).permutation(users.size)
    n_test = int(np.ceil(users.size * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return RatingDataset(
        name, n_users, n_items, scale,
        Ratings(users[train], items[train], values[train]),
        Ratings(users[test], items[test], values[test]),
        meta={"file": str(path), "split_seed": seed},
    ).validate(str(path))


def load_srgcnn_mat(name: str, path: Path, scale: RatingScale) -> RatingDataset:
    """sRGCNN `.mat` (keys M, Otraining, Otest): the fixed train/test masks over the rating matrix."""
    arrays = read_mat_v73(path, ("M", "Otraining", "Otest"))
    m, o_train, o_test = arrays["M"], arrays["Otraining"], arrays["Otest"]
    for key in ("Otraining", "Otest"):
        bad = np.argwhere(~np.isin(arrays[key], (0.0, 1.0)))
        if bad.size:
            r, c = bad[0]
            raise DataError(f"{path}: key '{key}' = {arrays[key][r, c]} at (row {r + 1}, column {c + 1}); "
                            f"expected a 0/1 mask")
    if (o_train.astype(bool) & o_test.astype(bool)).any():
        raise DataError(f"{path}: keys 'Otraining' and 'Otest' overlap (expected disjoint masks)")
    tr_u, tr_i = np.nonzero(o_train)
    te_u, te_i = np.nonzero(o_test)
    tr_r = m[tr_u, tr_i].astype(np.float32)
    te_r = m[te_u, te_i].astype(np.float32)
    if not (np.isfinite(tr_r).all() and np.isfinite(te_r).all()):
        raise DataError(f"{path}: key 'M' has NaN or infinite ratings under the 'Otraining'/'Otest' masks")
    if (tr_r == 0).any() or (te_r == 0).any():
        raise DataError(f"{path}: key 'M' has zero ratings under the 'Otraining'/'Otest' masks")
    _check_scale(path, np.concatenate([tr_r, te_r]), scale)
    return RatingDataset(
        name, int(m.shape[0]), int(m.shape[1]), scale,
        Ratings(tr_u.astype(np.int64), tr_i.astype(np.int64), tr_r),
        Ratings(te_u.astype(np.int64), te_i.astype(np.int64), te_r),
        meta={"file": str(path)},
    ).validate(str(path))


def _filter_k_core(users: np.ndarray, items: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask keeping interactions whose user and item both have >= k interactions (iterated)."""
    keep = np.ones(users.size, bool)
    while True:
        u_cnt = np.bincount(users[keep], minlength=users.max() + 1)
        i_cnt = np.bincount(items[keep], minlength=items.max() + 1)
        new_keep = keep & (u_cnt[users] >= k) & (i_cnt[items] >= k)
        if new_keep.sum() == keep.sum():
            return keep
        keep = new_keep


def load_gadtcdr(name: str, root: Path, domains: tuple[str, ...], seed: int, min_count: int = 5,
                 positive_from: float = 4.0) -> MultiDomainDataset:
    """Douban domains of GA-DTCDR (`user \\t item \\t rating`, shared 1-based user ids).

    Positives are ratings >= `positive_from`; users and items with fewer than `min_count`
    positives are filtered; each user's test item is one positive drawn with `seed`.
    """
    raw = []
    for dom in domains:
        path = root / dom / "ratings.dat"
        u, i, r = read_delimited(path, None, 3, id_low=1)  # 1-based ids
        pos = r >= positive_from
        raw.append((dom, u[pos] - 1, i[pos] - 1))
    num_users = int(max(u.max() for _, u, _ in raw)) + 1
    rng = np.random.default_rng(seed)
    out = []
    for dom, u, i in raw:
        keep = _filter_k_core(u, i, min_count)
        u, i = u[keep], i[keep]
        items_uniq, i = np.unique(i, return_inverse=True)
        out.append(_leave_one_out(dom, u, i.astype(np.int64), int(items_uniq.size), rng))
    return MultiDomainDataset(name, num_users, out, meta={"root": str(root), "seed": seed})


def _leave_one_out(dom: str, users: np.ndarray, items: np.ndarray, num_items: int, rng: np.random.Generator) -> Domain:
    order = np.lexsort((items, users))
    users, items = users[order], items[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    counts = np.diff(np.r_[starts, users.size])
    pick = starts + (rng.random(starts.size) * counts).astype(np.int64)
    test_mask = np.zeros(users.size, bool)
    test_mask[pick[counts >= 2]] = True  # a user needs a training positive left
    return Domain(dom, num_items, users[~test_mask], items[~test_mask], users[test_mask], items[test_mask])


def load_disencdr_pair(name: str, root: Path, a: str, b: str, test_file: str = "test.txt") -> MultiDomainDataset:
    """DisenCDR pair `<root>/<a>_<b>` (domain a) and `<root>/<b>_<a>` (domain b): 0-based shared user ids."""
    domains = []
    num_users = 0
    for folder, dom in ((f"{a}_{b}", a), (f"{b}_{a}", b)):
        base = root / folder
        if not base.is_dir():
            raise DataError(f"missing folder {base} (expected train.txt and {test_file} for domain '{dom}')")
        tr_u, tr_i, _ = read_delimited(base / "train.txt", None, 2, value_col=None)
        te_u, te_i, _ = read_delimited(base / test_file, None, 2, value_col=None)
        check_disjoint(base / "train.txt", tr_u, tr_i, base / test_file, te_u, te_i)
        num_items = int(max(tr_i.max(), te_i.max())) + 1
        num_users = max(num_users, int(max(tr_u.max(), te_u.max())) + 1)
        domains.append(Domain(dom, num_items, tr_u, tr_i, te_u, te_i))
    return MultiDomainDataset(name, num_users, domains, meta={"root": str(root), "test_file": test_file})
