"""Metrics against hand-computed values."""

import numpy as np

from fedrec_flwr.metrics import (
    hit_ratio_at_k,
    ndcg_at_k,
    rank_of_positive,
    rmse,
    sample_negatives,
)


def test_rmse_clips_to_scale():
    assert np.isclose(rmse(np.array([7.0, 0.0]), np.array([5.0, 1.0]), 1, 5), 0.0)
    assert np.isclose(rmse(np.array([3.0, 3.0]), np.array([5.0, 1.0]), 1, 5), 2.0)


def test_hr_and_ndcg():
    ranks = rank_of_positive(np.array([0.9, 0.1]), np.array([[0.1, 0.2, 0.3], [0.5, 0.6, 0.0]]))
    assert ranks.tolist() == [0, 2]
    assert hit_ratio_at_k(ranks, 1) == 0.5 and hit_ratio_at_k(ranks, 3) == 1.0
    assert np.isclose(ndcg_at_k(ranks, 3), (1.0 + 1.0 / np.log2(4)) / 2)


def test_negatives_avoid_positives():
    rng = np.random.default_rng(0)
    neg = sample_negatives(rng, 120, set(range(20)), 99)
    assert len(set(neg.tolist())) == 99 and min(neg) >= 20
