"""FPPDM user-space analysis (fedrec_flwr.fppdm.analysis): W2 distances, the scale of a user space and
per-user ranks with some users' distributions replaced; and the overlap measurement built on them
(benchmarks/fppdm_overlap.py, run as a script on tiny synthetic domains): the shared / one-domain split
of every domain's test users adds up, and the barycenter distances are finite."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedrec_flwr.config import load_config
from fedrec_flwr.data.synthetic import make_synthetic_multidomain
from fedrec_flwr.fppdm.analysis import space_scale, user_ranks, w2
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer

ROOT = Path(__file__).resolve().parents[1]

# two variants of two rounds, D = 8, on synthetic-md2 (300 users over 2 domains of 200 items): seconds
TINY = ["fppdm.model.dim=8", "federation.rounds=2", "federation.eval_every=2", "fppdm.training.local_epochs=1"]


def test_space_scale_and_w2_on_known_points():
    mu = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    sigma = np.zeros_like(mu)
    scale = space_scale(mu, sigma, block=2)  # blocks smaller than the users
    pairs = [5.0, 1.0, math.sqrt(9 + 9)]
    assert math.isclose(scale["random_pair_w2"], np.mean(pairs))
    assert math.isclose(scale["nearest_user_w2"], np.mean([1.0, math.sqrt(18), 1.0]))
    assert np.allclose(w2(mu[:1], sigma[:1] + 1, mu[1:2], sigma[1:2] + 1), [5.0])
    assert np.allclose(w2(mu[:1], sigma[:1], mu[:1], sigma[:1] + 2), [math.sqrt(8)])  # sigma counts too


def test_ranking_with_replaced_users_changes_only_those_users():
    ds = make_synthetic_multidomain(seed=0, num_domains=2)
    cfg = load_config("fppdm", "synthetic-md2", ["fppdm.model.dim=8", "fppdm.training.local_epochs=1"])
    f = cfg.fppdm
    tr = DomainTrainer(DomainData(ds.domains[0]), 0, f.model, f.training, f.coclustering, cfg.seed)
    mu, sigma = tr.user_distributions()
    own = user_ranks(tr, f.evaluation)
    rows = np.arange(0, mu.shape[0], 2)  # every other local user
    assert np.array_equal(user_ranks(tr, f.evaluation, (rows, mu[rows], sigma[rows])), own)  # its own view: unchanged
    far = user_ranks(tr, f.evaluation, (rows, mu[rows] + 100.0, sigma[rows]))  # far from every item
    moved = np.isin(tr.data.test_users, rows)
    assert np.array_equal(far[~moved], own[~moved]) and not np.array_equal(far[moved], own[moved])


def _script(*argv: str) -> subprocess.CompletedProcess:
    """benchmarks/fppdm_overlap.py as a user runs it, from the project's folder, on one thread."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fppdm_overlap", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_overlap_measurement_splits_users_that_add_up_and_finite_barycenter_distances(tmp_path):
    out = tmp_path / "overlap.json"
    _script("--dataset", "synthetic-md2", "--only", "single_domain", "fppdm", "--out", str(out), "--set", *TINY)
    doc = json.loads(out.read_text())
    ds = make_synthetic_multidomain(seed=0, num_domains=2)  # what synthetic-md2 is (data.seed 0)
    results = doc["variants"]
    assert list(results) == ["single_domain", "fppdm"] and set(doc["settings"]) == set(results)
    assert [doc["settings"][n]["fppdm.server"]["aggregate"] for n in results] == [False, True]
    assert all(s["federation"]["rounds"] == 2 and s["fppdm.model"]["dim"] == 8 for s in doc["settings"].values())
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
                assert math.isclose(whole, m["all"][f"hr@{k}"], abs_tol=1e-12)
                assert math.isclose(r["mean_over_domains"][f"hr@{k}"],
                                    np.mean([d["all"][f"hr@{k}"] for d in r["domains"].values()]))
            assert m["shared_to_barycenter_w2"] > 0 and m["random_pair_w2"] > m["nearest_user_w2"] > 0
        # with two domains the barycenter is the midpoint: both domains' shared users are moved equally far
        a, b = (d["shared_to_barycenter_w2"] for d in r["domains"].values())
        assert math.isclose(a, b, rel_tol=1e-4)
    assert doc["table"].count("\n| fppdm |") == 1 + 3 * 2 + 2 and "only here" in doc["table"]

    summary = _script("--summarise", str(out)).stdout  # the summary over seeds of the file just written
    assert "seeds [0]" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| single_domain |"))
    cells = [c.strip() for c in row.strip("|").split("|")]  # variant, mean HR@5, then one Δ per domain and group
    assert cells[1] == f"{results['single_domain']['mean_over_domains']['hr@5']:.4f} ± 0.0000"
    assert cells[2:6] == ["+0.0000 ± 0.0000"] * 4  # single_domain against itself
