"""The accounted LDP budget: upload counts equal the sampling, and the accountant agrees with basic composition."""

from __future__ import annotations

import numpy as np
import pytest
from oracle_rdp import ldp_epsilon

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.accounting import budget, epsilon_per_coordinate, tight_epsilon
from fedrec_flwr.fedgnn.server import sample_users


def test_one_coordinate_is_the_papers_epsilon_and_tight_is_the_laplace_rdp_bound():
    """epsilon per coordinate is 2 delta / lambda; the tight figure is the Renyi-DP bound of that many Laplace
    mechanisms, computed here from Mironov's closed form (tests/oracle_rdp.py), or the basic sum where that is
    smaller (a few mechanisms), and never far above what the PLD accountant (near-exact) gives."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    assert (epsilon_per_coordinate(0.1, 0.2) == pytest.approx(1.0)
            and epsilon_per_coordinate(0.05, 0.5) == pytest.approx(0.2))
    for clip, noise, delta in ((0.1, 0.2, 1e-5), (0.1, 0.2, 1e-9), (0.05, 0.3, 1e-6)):
        for m in (1, 2, 10, 100, 1000, 10**6):
            assert tight_epsilon(clip, noise, m, delta) == pytest.approx(ldp_epsilon(clip, noise, m, delta), rel=1e-9)
    # the basic sum is the bound for a few mechanisms, the RDP one (well below the sum) for many
    assert tight_epsilon(0.1, 0.2, 2, 1e-5) == 2.0 and ldp_epsilon(0.1, 0.2, 10, 1e-5) < 10.0
    assert ldp_epsilon(0.1, 0.2, 10**6, 1e-5) < 0.5 * 10**6
    assert tight_epsilon(0.1, 0.4, 1000, 1e-5) < tight_epsilon(0.1, 0.2, 1000, 1e-5)  # more noise, less spent
    for m in (10, 100, 1000):  # a second accountant: privacy loss distributions of the same Laplace mechanisms
        pld = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                                   value_discretization_interval=1e-3)
        pld.compose(dp_accounting.LaplaceDpEvent(0.2 / (2 * 0.1)), m)
        exact = pld.get_epsilon(1e-5)
        assert exact <= tight_epsilon(0.1, 0.2, m, 1e-5) <= 1.05 * exact


def test_budget_reports_per_upload_and_per_user_totals():
    out = budget(0.1, 0.2, np.array([100, 100, 200]), np.array([3, 1, 2]), 1e-5)
    assert out["per_upload"]["coordinates"] == 200 and out["per_upload"]["basic"] == pytest.approx(200)
    assert out["per_user_run"]["max"]["basic"] == pytest.approx(400) and out["per_user_run"]["max"]["uploads"] == 2
    assert out["per_user_run"]["median"]["basic"] == pytest.approx(300)
    assert out["delta"] == 1e-5 and "user-level" in out["neighbouring"]


def test_recorded_upload_counts_equal_the_sampling(tiny_cfg):
    cfg = tiny_cfg("federation.rounds=5", "federation.clients_per_round=12", "federation.eval_every=5")
    out = run_in_process(cfg, log_every=0)
    parts = UserPartitions(prepare_partitions(cfg.data))
    users = [u for u in range(parts.meta.num_users) if parts.user(u).train_items.size]
    expected = np.zeros(parts.meta.num_users, np.int64)
    for rnd in range(2, 7):
        expected[sample_users(cfg.seed, rnd, users, 12)] += 1
    counts = expected[users]
    assert out["uploads_per_user"] == {"max": int(counts.max()), "median": float(np.median(counts)),
                                       "total": int(expected.sum())}


def test_the_accountant_records_uploads_and_resumes_from_its_checkpoint_state():
    """Events in, epsilon on demand: a user's budget grows with its uploads, and an accountant restored from
    another's state reports the same budget (the server checkpoint carries it)."""
    from fedrec_flwr.fedgnn.accounting import LDPAccountant

    first = LDPAccountant(3, 0.1, 0.2, 1e-5)
    for user in (0, 0, 2):
        first.record_upload(user)
    coordinates = {0: 100, 1: 100, 2: 100}
    spent = first.budget(coordinates)
    assert spent["per_user_run"]["max"]["uploads"] == 2 and spent["per_user_run"]["max"]["basic"] == pytest.approx(200)
    assert first.upload_counts([0, 1, 2]) == {"max": 2, "median": 1.0, "total": 3}
    resumed = LDPAccountant(3, 0.1, 0.2, 1e-5)
    resumed.restore(first.state())
    assert resumed.budget(coordinates) == spent
    resumed.record_upload(1)
    assert resumed.budget(coordinates)["per_user_run"]["median"]["uploads"] == 1
    with pytest.raises(ValueError, match="upload counts of 3 users, this run has 4"):
        LDPAccountant(4, 0.1, 0.2, 1e-5).restore(first.state())
    assert LDPAccountant(3, 0.1, 0.2, 1e-5, ldp=False).budget(coordinates) is None
