"""Analysis of a trained FPPDM domain's user space, for measurements (benchmarks/fppdm_overlap.py): W2
distances between users' Gaussians, the scale of a domain's user space, and per-user ranks of the
test positives, with some users' distributions replaced (e.g. by their barycenters).
"""

from __future__ import annotations

import numpy as np
import torch

from fedrec_flwr.config import FPPDMEvaluationConfig
from fedrec_flwr.fppdm.domain import DomainTrainer, positive_ranks
from fedrec_flwr.models.gaussian_gcn import w2_squared


def w2(mu_a: np.ndarray, sigma_a: np.ndarray, mu_b: np.ndarray, sigma_b: np.ndarray) -> np.ndarray:
    """Row-wise W2 distance between diagonal Gaussians: sqrt(|mu_a - mu_b|^2 + |sigma_a - sigma_b|^2)
    (the square root of the training loss's `w2_squared`, on arrays)."""
    return np.sqrt(w2_squared(mu_a, sigma_a, mu_b, sigma_b))


def space_scale(mu: np.ndarray, sigma: np.ndarray, block: int = 1024) -> dict[str, float]:
    """Mean W2 over all pairs of distinct users and mean W2 to the nearest other user: the space's scale.

    Distances are computed `block` users at a time against all users, so memory is block x users."""
    x = np.concatenate([mu, sigma], 1).astype(np.float64)  # W2 between diagonal Gaussians = L2 of (mu, sigma)
    sq = (x * x).sum(1)
    total, nearest = 0.0, np.empty(x.shape[0])
    for start in range(0, x.shape[0], block):
        d = np.sqrt(np.maximum(sq[start:start + block, None] + sq[None, :] - 2 * x[start:start + block] @ x.T, 0))
        rows = np.arange(start, min(start + block, x.shape[0]))
        d[rows - start, rows] = 0.0
        total += d.sum()
        d[rows - start, rows] = np.inf
        nearest[rows] = d.min(1)
    n = x.shape[0]
    return {"random_pair_w2": float(total / (n * (n - 1))), "nearest_user_w2": float(nearest.mean())}


def user_ranks(trainer: DomainTrainer, evaluation: FPPDMEvaluationConfig,
               replace: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """0-based rank of each test user's positive against the negatives `DomainTrainer.evaluate` draws (its
    seed), so that groups of users can be scored apart. `replace` = (local user rows, mu, sigma): those
    users are ranked with the given distributions (e.g. their barycenters) instead of their own."""
    with torch.no_grad():
        mu, sigma = (t.cpu().numpy().copy() for t in trainer.model())
    if replace is not None:
        rows, mu_rows, sigma_rows = replace
        mu[rows], sigma[rows] = mu_rows, sigma_rows
    return positive_ranks(trainer.data, mu, sigma, evaluation, trainer.evaluation_seed)
