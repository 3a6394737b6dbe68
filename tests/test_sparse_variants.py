"""Sparse and cold variants of a rating dataset (`data.train_per_user`, `data.cold_fraction`): the training ratings
thinned to a target per user, some users with none, the test ratings untouched and every one of them scored."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.cli.inprocess import ITEM_GROUPS, run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import DataError, load_from_config, prepare_partitions
from fedrec_flwr.reference.baselines import baseline_rmses


def _data(tmp_path, *overrides):
    return load_config("fedgnn_paper", "synthetic", [f"data.cache_dir={tmp_path / 'cache'}",
                                                     "data.synthetic.num_users=400", *overrides]).data


def test_a_sparse_variant_keeps_the_target_per_user_and_the_cold_users_keep_none(tmp_path):
    full = load_from_config(_data(tmp_path))
    sparse = load_from_config(_data(tmp_path, "data.train_per_user=3.5", "data.cold_fraction=0.1"))
    again = load_from_config(_data(tmp_path, "data.train_per_user=3.5", "data.cold_fraction=0.1"))
    for a, b in ((full.test, sparse.test), (sparse.train, again.train)):  # same test ratings; seeded
        assert np.array_equal(a.users, b.users) and np.array_equal(a.items, b.items)
        assert np.array_equal(a.values, b.values)
    assert len(sparse.train) / full.num_users == pytest.approx(3.5, abs=0.35)
    per_user = np.bincount(sparse.train.users, minlength=full.num_users)
    with_test = np.unique(full.test.users)
    cold = with_test[per_user[with_test] == 0]
    assert sparse.meta["cold_users"] == round(0.1 * with_test.size) and cold.size >= sparse.meta["cold_users"]
    # a kept rating is one of the full set's (a subset, not a redraw)
    full_keys = set(zip(full.train.users.tolist(), full.train.items.tolist()))
    assert set(zip(sparse.train.users.tolist(), sparse.train.items.tolist())) <= full_keys
    other = load_from_config(_data(tmp_path, "data.train_per_user=3.5", "data.cold_fraction=0.1", "data.seed=1"))
    assert not np.array_equal(other.train.items[:50], sparse.train.items[:50])


def test_a_variant_has_its_own_cache_and_an_impossible_target_is_refused(tmp_path):
    assert prepare_partitions(_data(tmp_path)) != prepare_partitions(_data(tmp_path, "data.train_per_user=9"))
    with pytest.raises(DataError, match="asks for more than"):
        load_from_config(_data(tmp_path, "data.train_per_user=1000"))


def test_every_test_rating_of_a_sparse_variant_is_scored_cold_users_included(tiny_cfg):
    cfg = tiny_cfg("data.train_per_user=3.5", "data.cold_fraction=0.2", "federation.rounds=2",
                   "federation.eval_every=2")
    out = run_in_process(cfg, log_every=0)
    assert out["eval_ratings"] == out["test_ratings"] > 0


def test_the_error_by_user_group_adds_up_to_the_run_s_and_names_the_cold_users(tiny_cfg):
    cfg = tiny_cfg("data.train_per_user=3.5", "data.cold_fraction=0.2", "federation.rounds=2",
                   "federation.eval_every=2")
    out = run_in_process(cfg, log_every=0, by_group=True)
    groups = out["by_user_group"]
    assert groups["all"]["rmse"] == pytest.approx(out["rmse"], rel=1e-9)
    assert sum(groups[g]["test_ratings"] for g in ("cold", "light", "rest")) == groups["all"]["test_ratings"]
    assert groups["cold"]["users"] >= round(0.2 * 60 * 0.5) and groups["cold"]["test_ratings"] > 0
    squared = sum(groups[g]["rmse"] ** 2 * groups[g]["test_ratings"] for g in ("cold", "light", "rest")
                  if groups[g]["test_ratings"])
    assert squared / groups["all"]["test_ratings"] == pytest.approx(out["rmse"] ** 2, rel=1e-9)


def test_the_final_model_scored_at_another_personal_shrink_is_what_a_run_at_it_gives(tiny_cfg):
    """`group_shrinks` (the sparse-variant benchmark's sweep of model.personal_shrink) scores one trained model at
    several k. k weighs the prediction only, so a run at k = 20 (the same fixed device secrets: the same draws)
    scores every group as the k = 5 run scored at k = 20 does, and the run's own k gives the run's own numbers."""
    base = ("data.train_per_user=3.5", "data.cold_fraction=0.2", "federation.rounds=2", "federation.eval_every=2",
            "model.population_bias=true")
    out = run_in_process(tiny_cfg(*base, "model.personal_shrink=5"), log_every=0, by_group=True,
                         group_shrinks=(5, 20))
    other = run_in_process(tiny_cfg(*base, "model.personal_shrink=20"), log_every=0, by_group=True)
    assert out["by_user_group_at_shrink"]["5"] == out["by_user_group"]
    at_20 = out["by_user_group_at_shrink"]["20"]
    for group, want in other["by_user_group"].items():
        assert at_20[group]["test_ratings"] == want["test_ratings"]
        assert (at_20[group]["rmse"] is None) == (want["rmse"] is None)
        if want["rmse"] is not None:
            assert at_20[group]["rmse"] == pytest.approx(want["rmse"], rel=1e-6)
    assert at_20["light"]["rmse"] != pytest.approx(out["by_user_group"]["light"]["rmse"], rel=1e-4)  # k matters
    assert at_20["cold"]["rmse"] == out["by_user_group"]["cold"]["rmse"]  # a cold user has no own part to weigh


def test_the_error_by_item_group_adds_up_to_the_run_s_and_its_baselines_are_on_the_same_ratings(tiny_cfg):
    """Split by how many training ratings their item has, the test ratings' errors add up to the run's: scoring a
    subset of a user's test items leaves each one's prediction as it is. Each group's baselines are scored on the
    group's own ratings (the global mean's error on one group is not the run's)."""
    cfg = tiny_cfg("data.train_per_user=3.5", "data.cold_fraction=0.2", "federation.rounds=2",
                   "federation.eval_every=2")
    out = run_in_process(cfg, log_every=0, by_group=True)
    by_item = out["by_item_group"]
    ds = load_from_config(cfg.data)
    counts = np.bincount(ds.train.items, minlength=ds.num_items)
    bounds = [*ITEM_GROUPS.values(), np.inf]
    assert sum(g["items"] for g in by_item.values()) == ds.num_items
    for (name, g), lo, hi in zip(by_item.items(), bounds, bounds[1:]):
        assert g["items"] == int(((counts >= lo) & (counts < hi)).sum())
        assert g["test_ratings"] == int(((counts[ds.test.items] >= lo) & (counts[ds.test.items] < hi)).sum())
    assert by_item["unrated"]["test_ratings"] > 0 and by_item["1-4"]["test_ratings"] > 0
    squared = sum(g["rmse"] ** 2 * g["test_ratings"] for g in by_item.values() if g["test_ratings"])
    assert squared / out["test_ratings"] == pytest.approx(out["rmse"] ** 2, rel=1e-6)
    unrated = np.flatnonzero(counts == 0)
    mean = ds.train.values.astype(np.float64).mean()
    on_them = ds.test.values[np.isin(ds.test.items, unrated)].astype(np.float64)
    want = float(np.sqrt(np.mean((np.clip(mean, ds.scale.low, ds.scale.high) - on_them) ** 2)))
    assert baseline_rmses(ds, items=unrated)["global_mean"] == pytest.approx(want, rel=1e-9)
