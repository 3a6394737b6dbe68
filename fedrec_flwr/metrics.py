"""Evaluation metrics: RMSE/MAE for ratings, HR@K/NDCG@K for ranking with sampled negatives."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class ErrorSums(NamedTuple):
    """Sums a client reports for its test ratings: squared errors, absolute errors, and how many ratings."""

    sse: float
    sae: float
    n: int


def clip_to_scale(pred: np.ndarray, low: float, high: float) -> np.ndarray:
    """Predictions clipped to the dataset's rating range; a NaN one (a model that overflowed) is the range's midpoint
    and +-inf its ends, so that the error sums a device reports stay finite."""
    return np.clip(np.where(np.isnan(pred), (low + high) / 2, pred), low, high)


def squared_error_sum(pred: np.ndarray, target: np.ndarray, low: float, high: float,
                      error_clip: float = float("inf")) -> ErrorSums:
    """Squared and absolute error sums and n after clipping the predictions to the scale (and each error to
    +-error_clip: user-level DP's released evaluation bounds what one rating adds); what a client reports."""
    err = clip_to_scale(np.asarray(pred, np.float64), low, high) - np.asarray(target, np.float64)
    if np.isfinite(error_clip):
        err = np.clip(err, -error_clip, error_clip)
    return ErrorSums(float(np.square(err).sum()), float(np.abs(err).sum()), int(err.size))


def rmse(pred: np.ndarray, target: np.ndarray, low: float, high: float) -> float:
    """Root mean squared error of clipped predictions."""
    sse, _, n = squared_error_sum(pred, target, low, high)
    return float(np.sqrt(sse / n)) if n else float("nan")


def mae(pred: np.ndarray, target: np.ndarray, low: float, high: float) -> float:
    """Mean absolute error of clipped predictions."""
    _, sae, n = squared_error_sum(pred, target, low, high)
    return sae / n if n else float("nan")


def rank_of_positive(pos_score: np.ndarray, neg_scores: np.ndarray) -> np.ndarray:
    """0-based rank of each row's positive among itself and its negatives (ties count against it)."""
    return (neg_scores >= pos_score[:, None]).sum(axis=1)


def hit_ratio_at_k(ranks: np.ndarray, k: int) -> float:
    """HR@K: fraction of test users whose positive ranks in the top K."""
    return float((ranks < k).mean()) if ranks.size else float("nan")


def ndcg_at_k(ranks: np.ndarray, k: int) -> float:
    """NDCG@K with one relevant item: 1/log2(rank+2) when it ranks in the top K, else 0."""
    if not ranks.size:
        return float("nan")
    gains = np.where(ranks < k, 1.0 / np.log2(ranks + 2.0), 0.0)
    return float(gains.mean())


def sample_negatives(rng: np.random.Generator, num_items: int, positives: set[int], count: int) -> np.ndarray:
    """`count` distinct items the user never interacted with, uniformly (rejection sampling)."""
    if num_items - len(positives) < count:
        raise ValueError(f"cannot sample {count} negatives: only {num_items - len(positives)} non-interacted items")
    out: list[int] = []
    seen = set(positives)
    while len(out) < count:
        for item in rng.integers(0, num_items, size=2 * (count - len(out))):
            item = int(item)
            if item not in seen:
                seen.add(item)
                out.append(item)
                if len(out) == count:
                    break
    return np.asarray(out, np.int64)
