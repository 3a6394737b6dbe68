"""The accounted LDP budget: upload counts equal the sampling, and the accountant agrees with basic composition."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.direct import run_direct
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.accounting import budget, epsilon_per_coordinate, tight_epsilon
from fedrec_flwr.fedgnn.server import sample_users


def test_one_coordinate_is_the_papers_epsilon_and_tight_never_exceeds_basic():
    assert epsilon_per_coordinate(0.1, 0.2) == pytest.approx(1.0)
    # a few mechanisms: basic composition is the tight bound, and the accountant reports it
    assert tight_epsilon(0.1, 0.2, 1, 1e-9) == pytest.approx(1.0)
    assert tight_epsilon(0.1, 0.2, 2, 1e-9) == pytest.approx(2.0)
    for m in (1, 10, 1000, 10**6):
        assert tight_epsilon(0.1, 0.2, m, 1e-5) <= m * 1.0 + 1e-6
    assert tight_epsilon(0.1, 0.2, 10**6, 1e-5) < 0.5 * 10**6  # composition of many: well below the sum
    assert tight_epsilon(0.1, 0.4, 1000, 1e-5) < tight_epsilon(0.1, 0.2, 1000, 1e-5)  # more noise, less spent


def test_budget_reports_per_upload_and_per_user_totals():
    out = budget(0.1, 0.2, np.array([100, 100, 200]), np.array([3, 1, 2]), 1e-5)
    assert out["per_upload"]["coordinates"] == 200 and out["per_upload"]["basic"] == pytest.approx(200)
    assert out["per_user_run"]["max"]["basic"] == pytest.approx(400) and out["per_user_run"]["max"]["uploads"] == 2
    assert out["per_user_run"]["median"]["basic"] == pytest.approx(300)
    assert out["delta"] == 1e-5 and "user-level" in out["neighbouring"]


def test_recorded_upload_counts_equal_the_sampling(tiny_cfg):
    cfg = tiny_cfg("federation.rounds=5", "federation.clients_per_round=12", "federation.eval_every=5")
    out = run_direct(cfg, log_every=0)
    parts = UserPartitions(prepare_partitions(cfg.data))
    users = [u for u in range(parts.meta.num_users) if parts.user(u).train_items.size]
    expected = np.zeros(parts.meta.num_users, np.int64)
    for rnd in range(2, 7):
        expected[sample_users(cfg.seed, rnd, users, 12)] += 1
    counts = expected[users]
    assert out["uploads_per_user"] == {"max": int(counts.max()), "median": float(np.median(counts)),
                                       "total": int(expected.sum())}
