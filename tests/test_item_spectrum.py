"""The item-table spectrum diagnostic (fedrec_flwr.fedgnn.spectrum): the noise threshold finds planted
structure, and truncated tables are evaluated by the same users and code as the full one."""

import numpy as np

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.fedgnn.spectrum import gavish_donoho_threshold, rank_cuts, spectrum_probe


def test_gavish_donoho_keeps_planted_components_and_drops_pure_noise():
    rng = np.random.default_rng(0)
    n, d = 1200, 200
    noise = rng.standard_normal((n, d))
    sv_noise = np.linalg.svd(noise, compute_uv=False)
    assert (sv_noise > gavish_donoho_threshold(sv_noise, noise.shape)).sum() == 0

    # three directions at 2x the noise bulk's edge (sqrt(n) + sqrt(d)), well inside what the threshold can see
    u, _ = np.linalg.qr(rng.standard_normal((n, 3)))
    v, _ = np.linalg.qr(rng.standard_normal((d, 3)))
    edge = np.sqrt(n) + np.sqrt(d)
    signal = (u * (2 * edge * np.array([1.5, 1.2, 1.0]))) @ v.T
    sv = np.linalg.svd(signal + noise, compute_uv=False)
    assert (sv > gavish_donoho_threshold(sv, noise.shape)).sum() == 3


def test_rank_cuts_are_the_best_low_rank_approximations():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((50, 20))
    sv = np.linalg.svd(a, compute_uv=False)
    cuts = rank_cuts(a, [1, 5, 20])
    assert sorted(cuts) == [1, 5, 20]
    for r, cut in cuts.items():
        err = np.linalg.norm(a - cut)
        assert np.isclose(err, np.sqrt((sv[r:] ** 2).sum()), rtol=1e-5, atol=1e-4)  # Eckart-Young; float32 output


def test_probe_at_full_rank_reproduces_the_run_rmse(tmp_path):
    cfg = load_config("fedgnn_tuned", "synthetic", [
        f"data.cache_dir={tmp_path}", "data.synthetic.num_users=60", "data.synthetic.num_items=80", "model.dim=16",
        "privacy.pseudo_items=20", "federation.clients_per_round=16", "federation.rounds=4", "federation.eval_every=2",
    ])
    out = run_in_process(cfg, log_every=0, probe=spectrum_probe([1, 16]))
    evals = [h for h in out["history"] if "rmse" in h]
    assert [h["round"] for h in evals] == [2, 4]
    for h in evals:
        assert np.isclose(h["rmse_at_rank"]["16"], h["rmse"], atol=1e-5)  # rank 16 = the whole 80 x 16 table
        assert h["rmse_at_rank"]["1"] != h["rmse"]
        assert 0 <= h["gd_rank"] <= 16 and len(h["singular_values"]) == 16
