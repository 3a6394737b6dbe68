"""Closed-form Wasserstein barycenter of diagonal Gaussians (FPPDM's aggregation rule).

For diagonal Gaussians N(mu_k, diag(s_k^2)) with weights w_k (sum 1) the 2-Wasserstein
barycenter is N(sum_k w_k mu_k, diag((sum_k w_k s_k)^2)): covariances commute, so the
fixed-point equation of Agueh & Carlier reduces to averaging the standard deviations.
"""

from __future__ import annotations

import numpy as np


def diagonal_barycenter(mus: list[np.ndarray], sigmas: list[np.ndarray], weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Barycenter (mu_bar, sigma_bar) of K diagonal Gaussians given as [dim] arrays of means and stds."""
    k = len(mus)
    w = np.full(k, 1.0 / k) if weights is None else np.asarray(weights, float) / np.sum(weights)
    mu = sum(wi * m for wi, m in zip(w, mus))
    sigma = sum(wi * s for wi, s in zip(w, sigmas))
    return np.asarray(mu, np.float32), np.asarray(sigma, np.float32)


def user_barycenters(
    uploads: list[tuple[np.ndarray, np.ndarray, np.ndarray]], num_users: int, dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-user barycenter over the domains where each user appears, with equal domain weights.

    uploads: (global user ids, mu [n, dim], sigma [n, dim]) per domain. Returns (ids, mu, sigma)
    for every user seen in any domain; a user present in one domain keeps its own distribution.
    """
    mu_sum = np.zeros((num_users, dim))
    sigma_sum = np.zeros((num_users, dim))
    count = np.zeros(num_users)
    for ids, mu, sigma in uploads:
        mu_sum[ids] += mu
        sigma_sum[ids] += sigma
        count[ids] += 1
    ids = np.flatnonzero(count)
    return ids, (mu_sum[ids] / count[ids, None]).astype(np.float32), (sigma_sum[ids] / count[ids, None]).astype(np.float32)
