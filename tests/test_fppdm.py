"""FPPDM: W2 maths, the barycenter's optimality, upload validation, and domains that learn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from clients.fppdm import FPPDMDomainClient
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer, sample_training_negatives
from fedrec_flwr.fppdm.barycenter import diagonal_barycenter, user_barycenters
from fedrec_flwr.config import load_config
from fedrec_flwr.data.synthetic import make_synthetic_multidomain
from fedrec_flwr.models.gaussian_gcn import w2_squared
from fedrec_flwr.messages import UploadRejected
from strategies.fppdm import validate_distributions


def test_w2_between_diagonal_gaussians_matches_the_general_formula():
    rng = np.random.default_rng(0)
    m1, m2 = rng.normal(size=4), rng.normal(size=4)
    s1, s2 = rng.uniform(0.5, 2, 4), rng.uniform(0.5, 2, 4)
    c1, c2 = np.diag(s1**2), np.diag(s2**2)
    # Bures: tr(C1 + C2 - 2 (C2^1/2 C1 C2^1/2)^1/2)
    root = np.diag(np.sqrt(s2**2 * s1**2))
    general = np.sum((m1 - m2) ** 2) + np.trace(c1 + c2 - 2 * root)
    got = w2_squared(*(torch.tensor(a) for a in (m1, s1, m2, s2))).item()
    assert np.isclose(got, general)


def test_closed_form_barycenter_minimises_sum_of_squared_w2():
    rng = np.random.default_rng(1)
    mus = [rng.normal(size=3) for _ in range(3)]
    sigmas = [rng.uniform(0.2, 3, 3) for _ in range(3)]
    w = np.array([0.2, 0.5, 0.3])
    mu_bar, s_bar = diagonal_barycenter(mus, sigmas, w)

    def objective(x):
        mu, log_s = x[:3], x[3:]
        return sum(wk * (np.sum((mu - m) ** 2) + np.sum((np.exp(log_s) - s) ** 2)) for wk, m, s in zip(w, mus, sigmas))

    res = minimize(objective, np.zeros(6), method="BFGS", options={"gtol": 1e-10})
    assert np.allclose(res.x[:3], mu_bar, atol=1e-5) and np.allclose(np.exp(res.x[3:]), s_bar, atol=1e-5)
    assert objective(np.r_[mu_bar, np.log(s_bar)]) <= res.fun + 1e-9


def test_user_barycenters_average_only_where_users_appear():
    a = (np.array([0, 2]), np.array([[1.0], [2.0]]), np.array([[1.0], [1.0]]))
    b = (np.array([2, 3]), np.array([[4.0], [6.0]]), np.array([[3.0], [2.0]]))
    ids, mu, sigma = user_barycenters([a, b], 5, 1)
    assert ids.tolist() == [0, 2, 3]
    assert mu[:, 0].tolist() == [1.0, 3.0, 6.0] and sigma[:, 0].tolist() == [1.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "arrays, reason",
    [
        ([np.array([0, 1]), np.zeros((2, 2)), np.ones((2, 2))], None),
        ([np.array([0, 0]), np.zeros((2, 2)), np.ones((2, 2))], "duplicate"),
        ([np.array([0, 9]), np.zeros((2, 2)), np.ones((2, 2))], "out of range"),
        ([np.array([0, 1]), np.zeros((2, 3)), np.ones((2, 2))], "mu has shape"),
        ([np.array([0, 1]), np.full((2, 2), np.nan), np.ones((2, 2))], "NaN"),
        ([np.array([0, 1]), np.zeros((2, 2)), -np.ones((2, 2))], "sigma must be non-negative"),
        ([np.array([0, 1]), np.zeros((2, 2))], "expected 3 arrays"),
    ],
)
def test_domain_uploads_are_validated(arrays, reason):
    if reason is None:
        validate_distributions(arrays, 5, 2)
    else:
        with pytest.raises(UploadRejected, match=reason):
            validate_distributions(arrays, 5, 2)


def _cfg(tmp_path, *extra):
    return load_config("fppdm", "synthetic-md3", [f"output_dir={tmp_path}", "fppdm.dim=16", "fppdm.local_epochs=2",
                                                  "fppdm.lr=0.01", *extra])


def test_negatives_are_never_positives():
    data = DomainData(make_synthetic_multidomain(seed=0).domains[0])
    users = np.repeat(np.arange(data.num_users), 20)
    neg = sample_training_negatives(np.random.default_rng(0), data, users)
    assert not data.is_positive(users, neg).any()


def test_domain_training_beats_random_ranking(tmp_path):
    cfg = _cfg(tmp_path)
    domain = make_synthetic_multidomain(seed=0).domains[0]
    trainer = DomainTrainer(cfg, DomainData(domain), 0)
    before = trainer.evaluate()
    for r in range(1, 4):
        trainer.train(r, np.zeros(0, np.int64), np.zeros((0, 16), np.float32), np.zeros((0, 16), np.float32))
    after = trainer.evaluate()
    assert after["hr@10"] > 0.2 and after["hr@10"] > before["hr@10"] + 0.05  # random: 10/100
    assert 0 <= after["ndcg@10"] <= after["hr@10"]


class _Store:
    def __init__(self):
        self.saved = None

    def load(self):
        return self.saved

    def save(self, arrays):
        self.saved = {k: v.copy() for k, v in arrays.items()}


def test_only_user_distributions_leave_a_domain_and_k3_rounds_run(tmp_path):
    from strategies.fppdm import WassersteinBarycenterStrategy

    cfg = _cfg(tmp_path, "fppdm.local_epochs=1")
    ds = make_synthetic_multidomain(seed=0, num_domains=3)
    stores = [_Store() for _ in ds.domains]
    strategy = WassersteinBarycenterStrategy(cfg, ds.num_users, 3)
    for rnd in (1, 2):
        uploads = []
        for k, dom in enumerate(ds.domains):
            client = FPPDMDomainClient(cfg, dom, k, stores[k])
            arrays, n, metrics = client.fit(strategy._for_domain(k), {"round": rnd})
            assert len(arrays) == 3 and set(metrics) == {"train_loss"}
            ids, mu, sigma = validate_distributions(arrays, ds.num_users, 16)
            assert np.array_equal(ids, np.unique(dom.train_users))  # this domain's users, nothing else
            strategy.domain_users[k] = ids
            uploads.append((ids, mu, sigma))
        strategy.global_ids, strategy.global_mu, strategy.global_sigma = user_barycenters(uploads, ds.num_users, 16)
    shared = np.intersect1d(np.intersect1d(uploads[0][0], uploads[1][0]), uploads[2][0])
    u = shared[0]
    expected = np.mean([mu[np.searchsorted(ids, u)] for ids, mu, _ in uploads], axis=0)
    assert np.allclose(strategy.global_mu[np.searchsorted(strategy.global_ids, u)], expected, atol=1e-6)
    only_one = np.setdiff1d(uploads[0][0], np.concatenate([uploads[1][0], uploads[2][0]]))
    if only_one.size:  # a user present in one domain keeps its own distribution
        v = only_one[0]
        assert np.allclose(strategy.global_mu[np.searchsorted(strategy.global_ids, v)], uploads[0][1][np.searchsorted(uploads[0][0], v)])


def test_fppdm_pp_round_pulls_users_towards_their_clusters(tmp_path):
    from fedrec_flwr.fppdm.coclustering import co_cluster

    cfg = _cfg(tmp_path, "fppdm.lambda_c=5.0", "fppdm.clusters=4", "fppdm.local_epochs=2")
    domain = make_synthetic_multidomain(seed=0).domains[0]
    trainer = DomainTrainer(cfg, DomainData(domain), 0)
    mu0, s0 = trainer.user_distributions()
    cl = co_cluster(mu0, s0, 4, cfg.fppdm.knn, cfg.fppdm.epsilon, cfg.fppdm.eta, seed=cfg.seed + 1)

    def spread(mu, s):
        c = cl.hard()
        return np.mean(np.sum((mu - cl.mu[c]) ** 2, 1) + np.sum((s - cl.sigma[c]) ** 2, 1))

    empty = np.zeros((0, 16), np.float32)
    loss = trainer.train(1, np.zeros(0, np.int64), empty, empty)
    assert np.isfinite(loss)
    assert spread(*trainer.user_distributions()) < spread(mu0, s0)  # compactness went up


def test_paillier_round_equals_plaintext_barycenter_and_server_sees_no_values(tmp_path):
    from fedrec_flwr.privacy.paillier_pack import DomainKeys
    from strategies.fppdm import WassersteinBarycenterStrategy

    key_file = tmp_path / "keys.json"
    DomainKeys.generate(1024).save(key_file)
    ds = make_synthetic_multidomain(seed=0, num_domains=3)
    results = {}
    for secure in (False, True):
        cfg = _cfg(tmp_path, "fppdm.local_epochs=1", "fppdm.dim=8", f"fppdm.secure={secure}",
                   f"fppdm.key_file={key_file}", "fppdm.key_bits=1024")
        stores = [_Store() for _ in ds.domains]
        strategy = WassersteinBarycenterStrategy(cfg, ds.num_users, 3)
        for rnd in (1, 2):
            fits = []
            for k, dom in enumerate(ds.domains):
                arrays, _, _ = FPPDMDomainClient(cfg, dom, k, stores[k]).fit(strategy._for_domain(k), {"round": rnd})
                fits.append((k, arrays))
            if secure:  # nothing the server receives is a float: ids, ciphertext bytes, the public modulus
                assert all(a.dtype.kind in "iu" for _, arrays in fits for a in arrays)
            strategy.aggregate_fit(rnd, [(_Proxy(k), _FitRes(arrays)) for k, arrays in fits], [])
        # what domain 0 trains towards in round 3
        reply = strategy._for_domain(0)
        client = FPPDMDomainClient(cfg, ds.domains[0], 0, stores[0])
        if secure:
            from fedrec_flwr.fppdm.secure_barycenter import decrypt_barycenters
            mu, sigma = decrypt_barycenters(client.keys, client.packer, reply[1], reply[2], 8)
        else:
            mu, sigma = reply[1], reply[2]
        results[secure] = (reply[0], mu, sigma)
    assert np.array_equal(results[False][0], results[True][0])
    assert np.allclose(results[False][1], results[True][1], atol=1e-4)
    assert np.allclose(results[False][2], results[True][2], atol=1e-4)


class _Proxy:
    def __init__(self, node_id):
        self.node_id = node_id


class _FitRes:
    def __init__(self, arrays):
        from flwr.common import ndarrays_to_parameters

        self.parameters = ndarrays_to_parameters(arrays)
        self.num_examples = 1
        self.metrics = {}
