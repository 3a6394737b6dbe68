"""FPPDM: W2 maths, the barycenter's optimality, upload validation, and rounds driven through the
strategy's public path (configure_fit -> client.fit -> aggregate_fit), as `flwr run` drives them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inprocess import Manager, drive
from scipy.optimize import minimize

from clients.fppdm import FPPDMDomainClient
from fedrec_flwr.config import load_config
from fedrec_flwr.data.synthetic import make_synthetic_multidomain
from fedrec_flwr.fppdm.barycenter import UserGaussians, user_barycenters
from fedrec_flwr.fppdm.domain import (
    DomainData,
    DomainTrainer,
    sample_training_negatives,
)
from fedrec_flwr.fppdm.rounds import MAX_ABS_MU, MAX_SIGMA, validate_distributions
from fedrec_flwr.messages import UploadRejected
from fedrec_flwr.models.gaussian_gcn import w2_squared
from fedrec_flwr.reporting.results import RunRecorder, load_results
from strategies.fppdm import WassersteinBarycenterStrategy


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
    """What the server computes for a user held by three domains is the minimiser of sum_k W2^2."""
    rng = np.random.default_rng(1)
    mus = [rng.normal(size=(1, 3)) for _ in range(3)]
    sigmas = [rng.uniform(0.2, 3, (1, 3)) for _ in range(3)]
    _, mu_bar, s_bar = user_barycenters([UserGaussians(np.array([0]), m, s) for m, s in zip(mus, sigmas)], 1, 3)
    mu_bar, s_bar = mu_bar[0].astype(float), s_bar[0].astype(float)

    def objective(x):
        mu, log_s = x[:3], x[3:]
        return sum(np.sum((mu - m[0]) ** 2) + np.sum((np.exp(log_s) - s[0]) ** 2) for m, s in zip(mus, sigmas))

    res = minimize(objective, np.zeros(6), method="BFGS", options={"gtol": 1e-10})
    assert np.allclose(res.x[:3], mu_bar, atol=1e-5) and np.allclose(np.exp(res.x[3:]), s_bar, atol=1e-5)
    assert objective(np.r_[mu_bar, np.log(s_bar)]) <= res.fun + 1e-9


def test_user_barycenters_average_only_where_users_appear():
    a = UserGaussians(np.array([0, 2]), np.array([[1.0], [2.0]]), np.array([[1.0], [1.0]]))
    b = UserGaussians(np.array([2, 3]), np.array([[4.0], [6.0]]), np.array([[3.0], [2.0]]))
    ids, mu, sigma = user_barycenters([a, b], 5, 1)
    assert ids.tolist() == [0, 2, 3]
    assert mu[:, 0].tolist() == [1.0, 3.0, 6.0] and sigma[:, 0].tolist() == [1.0, 2.0, 2.0]


IDS = np.array([0, 1])
ZEROS, ONES = np.zeros((2, 2)), np.ones((2, 2))


@pytest.mark.parametrize(
    "arrays, reason",
    [
        ([IDS, ZEROS, ONES], None),
        ([IDS, np.full((2, 2), -MAX_ABS_MU), np.full((2, 2), MAX_SIGMA)], None),  # the bounds themselves pass
        ([np.array([0, 0]), ZEROS, ONES], "duplicate"),
        ([np.array([0, 9]), ZEROS, ONES], "out of range"),
        ([np.array([-1, 1]), ZEROS, ONES], "out of range"),
        ([np.array([0.0, 1.0]), ZEROS, ONES], "integer"),
        ([IDS, np.zeros((2, 3)), ONES], "mu has shape"),
        ([IDS, ZEROS, np.ones((3, 2))], "sigma has shape"),
        ([IDS, np.full((2, 2), np.nan), ONES], "NaN"),
        ([IDS, ZEROS, np.full((2, 2), np.inf)], "NaN/Inf"),
        ([IDS, np.zeros((2, 2), np.int64), ONES], "non-float"),
        ([IDS, ZEROS, -ONES], "must be positive"),
        ([IDS, ZEROS, np.zeros((2, 2))], "must be positive"),
        ([IDS, np.full((2, 2), 2 * MAX_ABS_MU), ONES], "exceeds the bound"),
        ([IDS, ZEROS, np.full((2, 2), 2 * MAX_SIGMA)], "exceeds the bound"),
        ([IDS, ZEROS], "expected 3 arrays"),
    ],
)
def test_domain_uploads_are_validated(arrays, reason):
    if reason is None:
        got = validate_distributions(arrays, 5, 2)
        assert got.ids.dtype == np.int64 and got.mu.dtype == got.sigma.dtype == np.float32
    else:
        with pytest.raises(UploadRejected, match=reason):
            validate_distributions(arrays, 5, 2)


def test_point_embeddings_must_upload_zero_sigma():
    """fppdm.model.gaussian = false (the LightGCN baseline): sigma is exactly 0, anything else is refused."""
    validate_distributions([IDS, ZEROS, np.zeros((2, 2))], 5, 2, gaussian=False)
    with pytest.raises(UploadRejected, match="sigma must be 0"):
        validate_distributions([IDS, ZEROS, ONES], 5, 2, gaussian=False)


def _cfg(tmp_path, *extra):
    return load_config("fppdm", "synthetic-md3", [f"output_dir={tmp_path}", "fppdm.model.dim=16",
                                                  "fppdm.training.local_epochs=2", "fppdm.training.lr=0.01", *extra])


def _trainer(cfg, domain, index=0):
    """The domain core, given only the sections it reads."""
    f = cfg.fppdm
    return DomainTrainer(DomainData(domain), index, f.model, f.training, f.coclustering, cfg.seed)


def test_negatives_are_never_positives():
    data = DomainData(make_synthetic_multidomain(seed=0).domains[0])
    users = np.repeat(np.arange(data.num_users), 20)
    neg = sample_training_negatives(np.random.default_rng(0), data, users)
    assert not data.is_positive(users, neg).any()


def test_domain_training_beats_random_ranking(tmp_path):
    cfg = _cfg(tmp_path)
    domain = make_synthetic_multidomain(seed=0).domains[0]
    trainer = _trainer(cfg, domain)
    before = trainer.evaluate(cfg.fppdm.evaluation)
    for r in range(1, 4):
        trainer.train(r, np.zeros(0, np.int64), np.zeros((0, 16), np.float32), np.zeros((0, 16), np.float32))
    after = trainer.evaluate(cfg.fppdm.evaluation)
    assert after["hr@10"] > 0.2 and after["hr@10"] > before["hr@10"] + 0.05  # random: 10/100
    assert 0 <= after["ndcg@10"] <= after["hr@10"]


def test_fppdm_pp_round_pulls_users_towards_their_clusters(tmp_path):
    from fedrec_flwr.fppdm.coclustering import cluster_users

    cfg = _cfg(tmp_path, "fppdm.coclustering.lambda_c=5.0", "fppdm.coclustering.clusters=4",
               "fppdm.training.local_epochs=2")
    domain = make_synthetic_multidomain(seed=0).domains[0]
    trainer = _trainer(cfg, domain)
    mu0, s0 = trainer.user_distributions()
    cl = cluster_users(mu0, s0, cfg.fppdm.coclustering, seed=cfg.seed + 1)

    def spread(mu, s):
        c = cl.hard()
        return np.mean(np.sum((mu - cl.mu[c]) ** 2, 1) + np.sum((s - cl.sigma[c]) ** 2, 1))

    empty = np.zeros((0, 16), np.float32)
    loss = trainer.train(1, np.zeros(0, np.int64), empty, empty)
    assert np.isfinite(loss)
    assert spread(*trainer.user_distributions()) < spread(mu0, s0)  # compactness went up


# -- rounds through the strategy ---------------------------------------------------------------

class _Store:
    def __init__(self):
        self.saved = None

    def load(self):
        return self.saved

    def save(self, arrays):
        self.saved = {k: v.copy() for k, v in arrays.items()}


class _Recorded:
    """A domain client whose downloads and uploads the test can read afterwards."""

    def __init__(self, client):
        self.client, self.sent, self.uploads, self.metrics = client, [], [], []

    def fit(self, parameters, config):
        self.sent.append(parameters)
        arrays, n, metrics = self.client.fit(parameters, config)
        self.uploads.append(arrays)
        self.metrics.append(metrics)
        return arrays, n, metrics

    def evaluate(self, parameters, config):
        return self.client.evaluate(parameters, config)


class _FixedDomain:
    """A domain that uploads fixed Gaussians, `corrupt`ed in the rounds listed in `bad_rounds`."""

    def __init__(self, name, ids, mu, sigma, corrupt=None, bad_rounds=(), scores=None):
        self.name = name
        self.upload = [np.asarray(ids, np.int64), np.asarray(mu, np.float32), np.asarray(sigma, np.float32)]
        self.corrupt, self.bad_rounds, self.scores = corrupt, set(bad_rounds), scores
        self.sent = []

    def fit(self, parameters, config):
        self.sent.append(parameters)
        arrays = [a.copy() for a in self.upload]
        if int(config["round"]) in self.bad_rounds:
            arrays = self.corrupt(arrays)
        return arrays, 1, {}

    def evaluate(self, parameters, config):
        scores = {"hr@5": 0.25, "ndcg@5": 0.2, "hr@10": 0.5, "ndcg@10": 0.3, **(self.scores or {})}
        return 0.0, 10, {"n": 10, "domain": self.name, **scores}


def _fixed_domains(corrupt=None, bad_rounds=(), dim=2):
    """Three domains over 6 users: 0-3 in domain 0, 2-5 in domain 1, 1-4 in domain 2 (the one corrupted)."""
    rng = np.random.default_rng(3)

    def make(name, ids, **kw):
        ids = np.array(ids)
        return _FixedDomain(name, ids, rng.normal(size=(ids.size, dim)), rng.uniform(0.5, 2, (ids.size, dim)), **kw)

    return {0: make("d0", [0, 1, 2, 3]), 1: make("d1", [2, 3, 4, 5]),
            2: make("d2", [1, 2, 3, 4], corrupt=corrupt, bad_rounds=bad_rounds)}


def _strategy(tmp_path, *extra, num_users=6):
    cfg = load_config("fppdm", "synthetic-md3", [f"output_dir={tmp_path}", "fppdm.model.dim=2", "federation.rounds=3",
                                                 "federation.eval_every=3", *extra])
    recorder = RunRecorder(tmp_path, "fppdm", "fixed", {})
    return WassersteinBarycenterStrategy(cfg, num_users, 3, recorder), recorder


def _downloads(strategy, server_round, nodes):
    """What each node is sent in `server_round`, through the strategy's public configure_fit."""
    from flwr.common import parameters_to_ndarrays

    return {p.node_id: parameters_to_ndarrays(ins.parameters)
            for p, ins in strategy.configure_fit(server_round, None, Manager(nodes))}


def _expected(domains, nodes, users):
    """The barycenters of `users` over the fixed uploads of `nodes`."""
    bary = user_barycenters([UserGaussians(*domains[k].upload) for k in nodes], 6, 2)
    pos = np.searchsorted(bary.ids, users)
    return bary.mu[pos], bary.sigma[pos]


def _nan_mu(a):
    a[1][0, 0] = np.nan
    return a


def _negative_sigma(a):
    a[2][1, 1] = -0.5
    return a


def _huge_mu(a):
    a[1][0] = 10 * MAX_ABS_MU
    return a


def _huge_sigma(a):
    a[2][0] = 10 * MAX_SIGMA
    return a


def _foreign_user(a):
    a[0][-1] = 6  # no such user: ids are 0..5
    return a


@pytest.mark.parametrize("corrupt, reason", [(_nan_mu, "NaN"), (_negative_sigma, "must be positive"),
                                             (_huge_mu, "exceeds the bound"), (_huge_sigma, "exceeds the bound"),
                                             (_foreign_user, "out of range")])
def test_a_bad_upload_is_rejected_counted_and_never_averaged_in(tmp_path, corrupt, reason):
    domains = _fixed_domains(corrupt, bad_rounds={1})
    strategy, recorder = _strategy(tmp_path)
    drive(strategy, domains, last_round=1)
    rec = recorder.history()[0]
    assert (rec["clients"], rec["accepted"], rec["rejected"], rec["applied"]) == (3, 2, 1, True)
    assert [(r, why.split(":")[0]) for r, why in strategy.rounds.rejections] == [(1, "node 2")]
    assert reason in strategy.rounds.rejections[0][1]
    sent = _downloads(strategy, 2, domains)
    assert sent[2] == []  # the refused domain has no accepted upload: nothing to train towards yet
    for k in (0, 1):
        ids, mu, sigma = sent[k]
        want_mu, want_sigma = _expected(domains, (0, 1), domains[k].upload[0])
        assert np.array_equal(ids, domains[k].upload[0])
        assert np.allclose(mu, want_mu, atol=1e-6) and np.allclose(sigma, want_sigma, atol=1e-6)
        assert np.isfinite(mu).all() and (sigma > 0).all()


def test_too_few_accepted_uploads_leave_the_global_users_unchanged(tmp_path):
    """min_clients = 3: round 1 (all honest) is applied; round 2 (one refused upload) is not."""
    domains = _fixed_domains(_nan_mu, bad_rounds={2})
    strategy, recorder = _strategy(tmp_path, "federation.min_clients=3")
    drive(strategy, domains, last_round=2)
    r1, r2 = recorder.history()
    assert (r1["accepted"], r1["applied"]) == (3, True) and (r2["accepted"], r2["rejected"],
                                                             r2["applied"]) == (2, 1, False)
    after_round_1 = {k: d.sent[1] for k, d in domains.items()}  # what round 2 sent
    after_round_2 = _downloads(strategy, 3, domains)
    for k in domains:
        assert all(np.array_equal(a, b) for a, b in zip(after_round_1[k], after_round_2[k], strict=True))
    want_mu, _ = _expected(domains, (0, 1, 2), domains[0].upload[0])
    assert np.allclose(after_round_2[0][1], want_mu, atol=1e-6)


def test_min_clients_gates_the_first_round_too(tmp_path):
    domains = _fixed_domains(_negative_sigma, bad_rounds={1})
    strategy, recorder = _strategy(tmp_path, "federation.min_clients=3")
    drive(strategy, domains, last_round=1)
    assert recorder.history()[0]["applied"] is False
    assert all(d == [] for d in _downloads(strategy, 2, domains).values())


def test_evaluation_replies_out_of_range_are_rejected(tmp_path):
    domains = _fixed_domains()
    domains[1].scores = {"hr@10": 1.5}  # a hit ratio above 1: no honest domain sends it
    domains[2].scores = {"hr@10": 0.25}
    strategy, recorder = _strategy(tmp_path, "federation.rounds=1")
    drive(strategy, domains)
    final = recorder.history()[-1]
    assert final["hr@10"] == pytest.approx((0.5 + 0.25) / 2)
    assert any("hr@10 = 1.5" in why for _, why in strategy.rounds.rejections)


def test_only_user_distributions_leave_a_domain_and_k3_rounds_run(tmp_path):
    cfg = _cfg(tmp_path, "fppdm.training.local_epochs=1", "federation.rounds=3", "federation.eval_every=3")
    ds = make_synthetic_multidomain(seed=0, num_domains=3)
    recorder = RunRecorder(tmp_path, "fppdm", ds.name, {})
    strategy = WassersteinBarycenterStrategy(cfg, ds.num_users, 3, recorder)
    clients = {k: _Recorded(FPPDMDomainClient(cfg, dom, k, _Store())) for k, dom in enumerate(ds.domains)}
    drive(strategy, clients, last_round=2)
    assert all(r["accepted"] == 3 and r["rejected"] == 0 and r["applied"] for r in recorder.history())
    assert all(c.sent[0] == [] for c in clients.values())  # round 1: no global users yet
    for k, dom in enumerate(ds.domains):
        for arrays, metrics in zip(clients[k].uploads, clients[k].metrics):
            assert len(arrays) == 3 and set(metrics) == {"train_loss",
                                                         "refused_targets"} and metrics["refused_targets"] == 0
            ids, _, _ = validate_distributions(arrays, ds.num_users, 16)
            assert np.array_equal(ids, np.unique(dom.train_users))  # this domain's users, nothing else
    for sent, uploads in ((clients[0].sent[1], [c.uploads[0] for c in clients.values()]),  # round 2: round 1's
                          (_downloads(strategy, 3, clients)[0], [c.uploads[1] for c in clients.values()])):
        g_ids, g_mu, _ = sent
        assert np.array_equal(g_ids, uploads[0][0])
        shared = np.intersect1d(np.intersect1d(uploads[0][0], uploads[1][0]), uploads[2][0])
        u = shared[0]
        expected = np.mean([mu[np.searchsorted(ids, u)] for ids, mu, _ in uploads], axis=0)
        assert np.allclose(g_mu[np.searchsorted(g_ids, u)], expected, atol=1e-6)
        only_one = np.setdiff1d(uploads[0][0], np.concatenate([uploads[1][0], uploads[2][0]]))
        if only_one.size:  # a user present in one domain keeps its own distribution
            v = only_one[0]
            assert np.allclose(g_mu[np.searchsorted(g_ids, v)], uploads[0][1][np.searchsorted(uploads[0][0], v)])


def test_paillier_round_equals_plaintext_barycenter_and_server_sees_no_values(tmp_path):
    from fedrec_flwr.fppdm.secure_barycenter import decrypt_barycenters
    from fedrec_flwr.privacy.paillier_pack import DomainKeys

    key_file = tmp_path / "keys.json"
    DomainKeys.generate(1024).save(key_file)
    ds = make_synthetic_multidomain(seed=0, num_domains=3)
    results = {}
    for secure in (False, True):
        cfg = _cfg(tmp_path, "fppdm.training.local_epochs=1", "fppdm.model.dim=8", f"fppdm.secure.enabled={secure}",
                   "federation.rounds=3", "federation.eval_every=3", f"fppdm.secure.key_file={key_file}",
                   "fppdm.secure.key_bits=1024")
        strategy = WassersteinBarycenterStrategy(cfg, ds.num_users, 3)
        clients = {k: _Recorded(FPPDMDomainClient(cfg, dom, k, _Store())) for k, dom in enumerate(ds.domains)}
        drive(strategy, clients, last_round=2)
        if secure:  # nothing the server receives is a float: ids, ciphertext bytes, the public modulus
            assert all(a.dtype.kind in "iu" for c in clients.values() for arrays in c.uploads for a in arrays)
        reply = _downloads(strategy, 3, clients)[0]  # what domain 0 trains towards in round 3
        if secure:
            mu, sigma = decrypt_barycenters(clients[0].client.keys, clients[0].client.packer, reply[1], reply[2], 8)
        else:
            mu, sigma = reply[1], reply[2]
        results[secure] = (reply[0], mu, sigma)
    assert np.array_equal(results[False][0], results[True][0])
    assert np.allclose(results[False][1], results[True][1], atol=1e-4)
    assert np.allclose(results[False][2], results[True][2], atol=1e-4)


def test_the_round_core_reads_only_its_sections():
    """FPPDMRounds takes fppdm.model, fppdm.server, fppdm.secure and federation, not a whole AppConfig."""
    from fedrec_flwr.config import FederationConfig, FPPDMModelConfig, FPPDMServerConfig, SecureAggregationConfig
    from fedrec_flwr.fppdm.rounds import FPPDMRounds
    from fedrec_flwr.messages import NodeReply

    def rounds(**server):
        return FPPDMRounds(6, FPPDMModelConfig(dim=2), FPPDMServerConfig(**server), SecureAggregationConfig(),
                           FederationConfig(rounds=2, eval_every=1, min_clients=1))

    upload = [IDS, np.full((2, 2), 3.0, np.float32), np.ones((2, 2), np.float32)]
    tight = rounds(max_abs_mu=2.0)
    assert tight.validate_reply(1, NodeReply(0, upload)) is None
    assert "exceeds the bound 2" in tight.rejections[-1][1]
    alone = rounds(aggregate=False)
    alone.train(1, [NodeReply(0, upload)], [], 0.0)
    assert alone.global_users.ids.tolist() == [0, 1] and alone.download(0) == []  # nothing sent back


def test_every_test_user_of_every_domain_is_ranked_cold_users_too(tmp_path):
    """Each domain gets a cold test user (a test item, no training positive there; trained in another domain):
    it is ranked from its distribution as initialised, never trained or uploaded, and the run reports how many
    test users each domain ranked: all of them."""
    from dataclasses import replace

    cfg = _cfg(tmp_path, "fppdm.training.local_epochs=1", "federation.rounds=2", "federation.eval_every=2")
    ds = make_synthetic_multidomain(seed=0, num_domains=3)
    domains = []
    for k, dom in enumerate(ds.domains):
        other = np.unique(ds.domains[(k + 1) % 3].train_users)
        cold = int(np.setdiff1d(other, dom.train_users)[0])  # a user this domain has never seen
        domains.append(replace(dom, test_users=np.r_[dom.test_users, cold], test_items=np.r_[dom.test_items, 0]))
        data = DomainData(domains[-1])
        assert cold in data.cold_ids and cold not in data.global_ids
    recorder = RunRecorder(tmp_path, "fppdm", ds.name, {})
    strategy = WassersteinBarycenterStrategy(cfg, ds.num_users, 3, recorder)
    clients = {k: _Recorded(FPPDMDomainClient(cfg, dom, k, _Store())) for k, dom in enumerate(domains)}
    drive(strategy, clients)
    for k, dom in enumerate(domains):
        assert all(np.array_equal(arrays[0], np.unique(dom.train_users)) for arrays in clients[k].uploads)
    final = load_results(tmp_path)["final"]
    assert [final[f"{dom.name}/ranked"] for dom in domains] == [dom.test_users.size for dom in domains]
    assert final["ranked_users"] == sum(dom.test_users.size for dom in domains)
