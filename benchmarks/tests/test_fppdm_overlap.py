"""benchmarks/fppdm_overlap.py's core on tiny synthetic domains: the variants, the shared / one-domain split
of every domain's test users, and the barycenter distances."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.fppdm_overlap import markdown, run_variant, seed_summary, space_scale, user_ranks, variants, w2
from fedrec_flwr.data.synthetic import make_synthetic_multidomain
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer


def test_variants_differ_only_in_lambda_p_and_aggregation(tmp_path):
    configs = variants("synthetic-md3", [f"output_dir={tmp_path}"])
    assert list(configs) == ["single_domain", "fppdm_lp0", "fppdm", "fppdm_lp4x"]
    lam = configs["fppdm"].fppdm.training.lambda_p
    assert [c.fppdm.training.lambda_p for c in configs.values()] == [0.0, 0.0, lam, 4 * lam]
    assert [c.fppdm.server.aggregate for c in configs.values()] == [False, True, True, True]


def test_space_scale_and_w2_on_known_points():
    mu = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    sigma = np.zeros_like(mu)
    scale = space_scale(mu, sigma, block=2)  # blocks smaller than the users
    pairs = [5.0, 1.0, math.sqrt(9 + 9)]
    assert math.isclose(scale["random_pair_w2"], np.mean(pairs))
    assert math.isclose(scale["nearest_user_w2"], np.mean([1.0, math.sqrt(18), 1.0]))
    assert np.allclose(w2(mu[:1], sigma[:1] + 1, mu[1:2], sigma[1:2] + 1), [5.0])


def test_overlap_split_adds_up_and_barycenter_distances_are_finite(tmp_path):
    ds = make_synthetic_multidomain(seed=0, num_domains=2)
    configs = variants("synthetic-md3", [f"output_dir={tmp_path}", "fppdm.model.dim=8", "federation.rounds=2",
                                         "federation.eval_every=2", "fppdm.training.local_epochs=1"])
    results = {name: run_variant(configs[name], ds) for name in ("single_domain", "fppdm")}
    for r in results.values():
        assert set(r["domains"]) == {dom.name for dom in ds.domains}
        for dom in ds.domains:
            data, m = DomainData(dom), r["domains"][dom.name]
            other = [np.unique(o.train_users) for o in ds.domains if o is not dom][0]
            assert m["users"] == data.num_users and m["shared_users"] == np.isin(data.global_ids, other).sum()
            assert 0 < m["shared"]["users"] < m["all"]["users"]  # the synthetic domains have both kinds of user
            assert m["shared"]["users"] + m["only_here"]["users"] == m["all"]["users"] == data.test_users.size
            assert m["shared_ranked_by_barycenter"]["users"] == m["shared"]["users"]
            for k in (5, 10):  # the groups' metrics recombine into the domain's
                whole = (m["shared"][f"hr@{k}"] * m["shared"]["users"]
                         + m["only_here"][f"hr@{k}"] * m["only_here"]["users"]) / m["all"]["users"]
                assert math.isclose(whole, m["all"][f"hr@{k}"])
                assert math.isclose(r["mean_over_domains"][f"hr@{k}"],
                                    np.mean([d["all"][f"hr@{k}"] for d in r["domains"].values()]))
            assert m["shared_to_barycenter_w2"] > 0 and m["random_pair_w2"] > m["nearest_user_w2"] > 0
    # with two domains the barycenter is the midpoint: both domains' shared users are moved equally far
    for r in results.values():
        a, b = (d["shared_to_barycenter_w2"] for d in r["domains"].values())
        assert math.isclose(a, b, rel_tol=1e-4)
    table = markdown(results)
    assert table.count("\n| fppdm |") == 1 + 3 * 2 + 2 and "only here" in table


def test_seed_summary_reports_per_seed_differences_from_single_domain():
    def doc(seed, base, gain):
        def variant(hr):
            group = {"hr@5": hr}
            return {"mean_over_domains": {"hr@5": hr},
                    "domains": {"book": {"shared": group, "only_here": group, "shared_to_barycenter_w2": 1.0}}}
        return {"seed": seed, "variants": {"single_domain": variant(base), "fppdm": variant(base + gain)}}

    table = seed_summary([doc(0, 0.30, 0.01), doc(1, 0.40, 0.03)])
    assert "seeds [0, 1]" in table
    row = next(line for line in table.splitlines() if line.startswith("| fppdm |"))
    # mean +- std of the two seeds' HR@5 (0.31, 0.43), then the mean +- std of their differences (0.01, 0.03)
    assert "0.3700 ± 0.0849" in row and row.count("+0.0200 ± 0.0141") == 2


def test_ranking_with_replaced_users_changes_only_those_users():
    ds = make_synthetic_multidomain(seed=0, num_domains=2)
    cfg = variants("synthetic-md3", ["fppdm.model.dim=8", "fppdm.training.local_epochs=1"])["fppdm"]
    f = cfg.fppdm
    tr = DomainTrainer(DomainData(ds.domains[0]), 0, f.model, f.training, f.coclustering, cfg.seed)
    mu, sigma = tr.user_distributions()
    own = user_ranks(tr, f.evaluation)
    rows = np.arange(0, mu.shape[0], 2)  # every other local user
    assert np.array_equal(user_ranks(tr, f.evaluation, (rows, mu[rows], sigma[rows])), own)  # its own view: unchanged
    far = user_ranks(tr, f.evaluation, (rows, mu[rows] + 100.0, sigma[rows]))  # far from every item
    moved = np.isin(tr.data.test_users, rows)
    assert np.array_equal(far[~moved], own[~moved]) and not np.array_equal(far[moved], own[moved])
