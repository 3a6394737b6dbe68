"""The validation holdout (`data.holdout=validation`): a schedule chosen on it has never seen a test rating."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import ConfigError, load_config
from fedrec_flwr.data import DataError, UserPartitions, load_from_config, prepare_partitions
from fedrec_flwr.data.holdout import validation_split
from fedrec_flwr.reporting.convergence import rounds_to_flatten


def _pairs(r) -> set[tuple[int, int]]:
    return set(zip(r.users.tolist(), r.items.tolist()))


def test_validation_is_carved_from_training_ratings_only_and_every_user_keeps_some(tmp_path):
    """The validation set and the shrunk training set partition the training ratings exactly; the test ratings
    appear in neither; each user lends about the fraction of its own ratings and keeps at least one."""
    cfg = load_config("quickstart", None, [f"data.cache_dir={tmp_path}"])
    full = load_from_config(cfg.data)
    held = validation_split(full, 0.1, seed=0)
    assert _pairs(held.train) | _pairs(held.test) == _pairs(full.train)
    assert not _pairs(held.train) & _pairs(held.test)
    assert len(held.train) + len(held.test) == len(full.train)
    assert not _pairs(held.test) & _pairs(full.test)
    before = np.bincount(full.train.users, minlength=full.num_users)
    after = np.bincount(held.train.users, minlength=full.num_users)
    lent = before - after
    assert (after[before > 0] >= 1).all()
    assert (np.abs(lent - 0.1 * before) < 1 + 1e-9).all()  # randomised rounding: within one rating of f * n_u
    assert abs(lent.sum() / before.sum() - 0.1) < 0.01
    # rating values travel with their (user, item) pair
    lookup = {(u, i): v
              for u, i, v in zip(full.train.users.tolist(), full.train.items.tolist(), full.train.values.tolist())}
    assert all(lookup[(u, i)] == v
               for u, i, v in zip(held.test.users.tolist(), held.test.items.tolist(), held.test.values.tolist()))


def test_the_split_depends_on_the_data_seed_only():
    """Same data seed, same split (every run seed of a dataset is scored on the same validation ratings)."""
    cfg = load_config("quickstart", None, [])
    full = load_from_config(cfg.data)
    a, b, c = validation_split(full, 0.2, 3), validation_split(full, 0.2, 3), validation_split(full, 0.2, 4)
    assert _pairs(a.test) == _pairs(b.test)
    assert _pairs(a.test) != _pairs(c.test)


def test_a_validation_run_is_scored_on_the_validation_ratings_in_its_own_cache(tmp_path):
    """The partitions of a validation run live apart from the test run's, hold the validation ratings as its
    evaluation set, and a run on them scores exactly those."""
    common = [f"data.cache_dir={tmp_path}", "federation.rounds=2", "federation.eval_every=2"]
    test_cfg = load_config("quickstart", None, common)
    val_cfg = load_config("quickstart", None, [*common, "data.holdout=validation", "data.validation_fraction=0.2"])
    test_dir, val_dir = prepare_partitions(test_cfg.data), prepare_partitions(val_cfg.data)
    assert test_dir != val_dir
    full, val = UserPartitions(test_dir).meta, UserPartitions(val_dir).meta
    assert val.num_train + val.num_test == full.num_train
    out = run_in_process(val_cfg, log_every=0)
    assert out["eval_ratings"] == val.num_test and np.isfinite(out["rmse"])


def test_bad_holdout_settings_get_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match="data.holdout"):
        load_config("quickstart", None, ["data.holdout=valid"])
    with pytest.raises(ConfigError, match="data.validation_fraction"):
        load_config("quickstart", None, ["data.holdout=validation", "data.validation_fraction=1.0"])
    cfg = load_config("fppdm", "synthetic-md2", [f"data.cache_dir={tmp_path}", "data.holdout=validation"])
    with pytest.raises(DataError, match="multi-domain"):
        load_from_config(cfg.data)


def test_the_flatten_rule_waits_out_evaluation_noise_and_stops_on_the_plateau():
    """A curve that falls 0.001 per 20 rounds until round 700 and is flat after, with +-0.001 evaluation
    noise: the rule picks a round on the plateau for every noise draw, where a rule on single evaluations
    (smoothing 1) stops far too early on every one; a curve still falling is never called flat."""
    rounds = range(20, 1001, 20)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        noisy = {r: 1.0 - 0.00005 * min(r, 700) + rng.uniform(-0.001, 0.001) for r in rounds}
        chosen, flat = rounds_to_flatten(noisy)
        assert flat and 700 <= chosen <= 900, (seed, chosen)
        assert rounds_to_flatten(noisy, smoothing=1)[0] < 700
    assert rounds_to_flatten({r: 1.0 - 0.0002 * r for r in rounds}) == (1000, False)
    with pytest.raises(ValueError, match="evaluations"):
        rounds_to_flatten({20: 1.0, 40: 0.9})
