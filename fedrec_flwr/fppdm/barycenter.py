"""Closed-form Wasserstein barycenter of diagonal Gaussians (FPPDM's aggregation rule).

For diagonal Gaussians N(mu_k, diag(s_k^2)) with weights w_k (sum 1) the 2-Wasserstein
barycenter is N(sum_k w_k mu_k, diag((sum_k w_k s_k)^2)): covariances commute, so the
fixed-point equation of Agueh & Carlier reduces to averaging the standard deviations.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class UserGaussians(NamedTuple):
    """Diagonal Gaussians of some users: global user ids [n], means [n, dim] and standard deviations [n, dim]."""

    ids: np.ndarray
    mu: np.ndarray
    sigma: np.ndarray


def user_barycenters(uploads: list[UserGaussians], num_users: int, dim: int) -> UserGaussians:
    """Per-user barycenter over the domains where each user appears, with equal domain weights.

    uploads: one `UserGaussians` (or any (ids, mu, sigma) triple) per domain. Returns the
    barycenters of every user seen in any domain, ids sorted; a user present in one domain keeps
    its own distribution.
    """
    mu_sum = np.zeros((num_users, dim))
    sigma_sum = np.zeros((num_users, dim))
    count = np.zeros(num_users)
    for ids, mu, sigma in uploads:
        mu_sum[ids] += mu
        sigma_sum[ids] += sigma
        count[ids] += 1
    ids = np.flatnonzero(count)
    return UserGaussians(ids, (mu_sum[ids] / count[ids, None]).astype(np.float32),
                         (sigma_sum[ids] / count[ids, None]).astype(np.float32))
