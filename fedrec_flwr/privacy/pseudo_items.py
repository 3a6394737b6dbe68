"""Pseudo interacted items: fake gradient rows that hide which items a user rated.

Each user fixes, once, a set of pseudo items it never rated. Its anonymity set (rated
items, its test items and the pseudo items, sorted by id) is what the server learns; it
never changes, so intersecting uploads across rounds reveals nothing more. Every round the
pseudo rows are drawn from a Gaussian with the mean and (shrunk) covariance of that step's
real item-gradient rows, so their values match the real ones in first and second moments.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def num_pseudo(m: int, k: int, num_unrated: int) -> int:
    """max(M, K) pseudo items, as the paper requires, capped by how many unrated items exist."""
    return min(max(m, k), num_unrated)


def sample_pseudo_items(rng: np.random.Generator, num_items: int, exclude: np.ndarray, count: int) -> np.ndarray:
    """`count` distinct item ids uniformly from those not in `exclude`, sorted."""
    mask = np.ones(num_items, bool)
    mask[exclude] = False
    pool = np.flatnonzero(mask)
    if count > pool.size:
        raise ValueError(f"cannot draw {count} pseudo items from {pool.size} unrated items")
    return np.sort(rng.choice(pool, size=count, replace=False)).astype(np.int64)


class Shrinkage(NamedTuple):
    """A Ledoit-Wolf estimate (1 - alpha) S + alpha mu I, with the rows' mean."""

    mean: np.ndarray
    alpha: float
    mu: float


def ledoit_wolf_shrinkage(x: np.ndarray) -> Shrinkage:
    """The mean, shrinkage alpha and target variance mu of the Ledoit-Wolf estimate (1-a) S + a mu I.

    With K rows in d dimensions and K < d the sample covariance S is singular; the
    Ledoit-Wolf intensity is the data-driven amount of isotropic shrinkage. Every term is
    computed from the K x K Gram matrix, O(K^2 d), never forming the d x d matrix S.
    """
    n, p = x.shape
    mean = x.mean(0)
    if n < 2:
        var = float(np.mean(np.square(x))) if x.size else 0.0
        return Shrinkage(mean, 1.0, var)
    xc = x - mean
    gram = xc @ xc.T  # K x K; S = xc^T xc / n shares its non-zero spectrum (scaled by 1/n)
    trace_s = float(np.trace(gram)) / n
    fro2_s = float(np.sum(np.square(gram))) / n**2
    mu = trace_s / p
    d2 = fro2_s - 2 * mu * trace_s + mu * mu * p  # ||S - mu I||_F^2
    sq_norms = np.diag(gram)
    # (1/n^2) sum_k ||x_k x_k^T - S||_F^2 = (1/n^2) [sum ||x_k||^4 - 2/n sum_k ||xc x_k||^2 + n ||S||_F^2]
    b2_bar = float(np.sum(sq_norms**2) - 2.0 * np.sum(np.square(gram)) / n + n * fro2_s) / n**2
    alpha = 1.0 if d2 <= 0 else min(max(b2_bar, 0.0), d2) / d2
    return Shrinkage(mean, alpha, mu)


def pseudo_gradient_rows(rng: np.random.Generator, real_rows: np.ndarray, count: int) -> np.ndarray:
    """`count` rows ~ N(mean, (1-a) S + a mu I) fitted to `real_rows` by Ledoit-Wolf shrinkage.

    Sampled without forming the d x d matrix: the S part as a random mix of the centred real
    rows (covariance S exactly), the isotropic part as independent normal noise.
    """
    k, d = real_rows.shape
    if count == 0 or k == 0:  # no real rows (a user without training ratings): nothing to imitate
        return np.zeros((count, d), np.float32)
    mean, alpha, mu = ledoit_wolf_shrinkage(real_rows.astype(np.float64))
    out = rng.standard_normal((count, d), dtype=np.float32) * np.float32(np.sqrt(alpha * mu))
    out += mean.astype(np.float32)
    if k >= 2 and alpha < 1.0:
        xc = (real_rows - mean).astype(np.float32)
        out += np.float32(np.sqrt((1.0 - alpha) / k)) * (rng.standard_normal((count, k), dtype=np.float32) @ xc)
    return out

