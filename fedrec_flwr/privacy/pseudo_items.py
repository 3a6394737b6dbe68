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
import torch


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
    """A Ledoit-Wolf estimate (1 - alpha) S + alpha mu I, with the rows' mean (float64 tensors / floats)."""

    mean: torch.Tensor
    alpha: float
    mu: float


def ledoit_wolf_shrinkage(x: torch.Tensor) -> Shrinkage:
    """The mean, shrinkage alpha and target variance mu of the Ledoit-Wolf estimate (1-a) S + a mu I of rows x [n, p].

    With n rows in p dimensions the sample covariance S = xc^T xc / n shares its non-zero spectrum with the
    n x n Gram matrix xc xc^T, so every term (tr S, ||S||_F, sum_k ||x_k||^4) is computed from whichever
    of the two is smaller: O(n p min(n, p)), never more. Float64: the terms cancel.
    """
    return _fit(x)[0]


def _fit(x: torch.Tensor) -> tuple[Shrinkage, torch.Tensor | None]:
    """`ledoit_wolf_shrinkage`, and the p x p scatter xc^T xc when it was the smaller matrix (n > p), else None."""
    x = x.to(torch.float64)
    n, p = x.shape
    mean = x.mean(0)
    if n < 2:
        var = float(x.square().mean()) if x.numel() else 0.0
        return Shrinkage(mean, 1.0, var), None
    xc = x - mean
    small = xc @ xc.T if n <= p else xc.T @ xc  # Gram (n x n) or scatter (p x p): same Frobenius norm
    sq_norms = xc.square().sum(1)
    trace_s, fro2_s, sq4 = torch.stack([sq_norms.sum(), small.square().sum(), sq_norms.square().sum()]).tolist()
    trace_s, fro2_s = trace_s / n, fro2_s / n**2
    mu = trace_s / p
    d2 = fro2_s - 2 * mu * trace_s + mu * mu * p  # ||S - mu I||_F^2
    # (1/n^2) sum_k ||x_k x_k^T - S||_F^2 = (1/n^2) [sum_k ||x_k||^4 - n ||S||_F^2]
    b2_bar = (sq4 - n * fro2_s) / n**2
    alpha = 1.0 if d2 <= 0 else min(max(b2_bar, 0.0), d2) / d2
    return Shrinkage(mean, alpha, mu), (small if n > p else None)


def _normals(rng: np.random.Generator, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Standard normals of `shape` from `rng` as a float32 tensor on `device`."""
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(device)


def pseudo_gradient_rows(rng: np.random.Generator, real_rows: torch.Tensor, count: int) -> torch.Tensor:
    """`count` float32 rows ~ N(mean, (1-a) S + a mu I) fitted to `real_rows` [K, p] by Ledoit-Wolf shrinkage,
    on the rows' device; the standard normals come from `rng`, the user's secure stream (drawn on the CPU, so
    a run draws the same rows on CPU and CUDA, and a server that knows the run's seed cannot replay them).

    Sampled by the cheaper exact route: with K <= p as a random mix of the K centred real rows (covariance
    S exactly) plus isotropic noise, O(count K p); with K > p through the Cholesky factor of the p x p
    covariance, O(count p^2). Both give the same Gaussian.
    """
    k, p = real_rows.shape
    device = real_rows.device
    if count == 0 or k == 0:  # no real rows (a user without training ratings): nothing to imitate
        return torch.zeros((count, p), dtype=torch.float32, device=device)
    (mean, alpha, mu), scatter = _fit(real_rows)
    if scatter is not None and alpha < 1.0:  # k > p
        cov = (1.0 - alpha) * scatter / k + alpha * mu * torch.eye(p, dtype=torch.float64, device=device)
        factor, info = torch.linalg.cholesky_ex(cov)
        if int(info) == 0:
            z = _normals(rng, (count, p), device)
            return torch.addmm(mean.to(torch.float32), z, factor.T.to(torch.float32))
    out = _normals(rng, (count, p), device).mul_(float(np.sqrt(alpha * mu)))
    out += mean.to(torch.float32)
    if k >= 2 and alpha < 1.0:
        xc = (real_rows - mean.to(real_rows.dtype)).to(torch.float32)
        mix = _normals(rng, (count, k), device)
        out.addmm_(mix, xc, alpha=float(np.sqrt((1.0 - alpha) / k)))
    return out
