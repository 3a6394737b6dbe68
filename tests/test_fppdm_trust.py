"""FPPDM domains that cannot lie: evaluation replies bound to their node and checked key by key, value bounds
from the model's own scale, every decrypted barycenter checked by the domain, one Paillier key per run,
and uploads without users counting toward nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from clients.fppdm import FPPDMDomainClient
from fedrec_flwr.config import (
    FederationConfig,
    FPPDMModelConfig,
    FPPDMServerConfig,
    SecureAggregationConfig,
    load_config,
)
from fedrec_flwr.data.synthetic import make_synthetic_multidomain
from fedrec_flwr.fppdm.protocol import frame_ciphertexts, frame_gaussians
from fedrec_flwr.fppdm.rounds import MAX_ABS_MU, MAX_SIGMA, FPPDMRounds, value_bounds
from fedrec_flwr.fppdm.secure_barycenter import encrypt_users, public_n_array
from fedrec_flwr.messages import NodeReply
from fedrec_flwr.privacy.paillier_pack import DomainKeys

SCORES = {"hr@5": 0.2, "ndcg@5": 0.1, "hr@10": 0.3, "ndcg@10": 0.15}


def _rounds(num_users: int = 6, dim: int = 2, **kw) -> FPPDMRounds:
    fed = load_config("fppdm").federation
    return FPPDMRounds(num_users, FPPDMModelConfig(dim=dim), FPPDMServerConfig(),
                       kw.pop("secure", SecureAggregationConfig()), fed, None, domain_names=["book", "music"], **kw)


def _eval(node: int, domain: str, **scores) -> NodeReply:
    return NodeReply(node, metrics={"n": 4, "domain": domain, **{**SCORES, **scores}})


def test_a_reply_missing_or_adding_a_metric_is_refused_not_fatal():
    rounds = _rounds()
    missing = {k: v for k, v in SCORES.items() if k != "ndcg@10"}
    out = rounds.evaluate(1, [NodeReply(1, metrics={"n": 4, "domain": "book", **missing}), _eval(2, "music"),
                              _eval(3, "book", **{"hr@20": 0.5})])
    assert out == {k: v for k, v in SCORES.items()} and rounds.final["ranked_users"] == 4  # music alone
    reasons = [why for _, why in rounds.rejections]
    assert any("missing ['ndcg@10']" in r for r in reasons) and any("unexpected ['hr@20']" in r for r in reasons)


def test_a_node_cannot_take_another_domains_metrics():
    """A node naming the honest node's domain first: both claims of a round are refused, the binding is by
    node, and with a node list a node may only name its listed domain."""
    rounds = _rounds()
    rounds.evaluate(1, [_eval(7, "book", **{"hr@10": 0.9}), _eval(8, "book")])  # two nodes, one name
    assert "book" not in rounds.domain_of_node.values()
    rounds.evaluate(2, [_eval(8, "book"), _eval(9, "music")])
    assert rounds.domain_of_node == {8: "book", 9: "music"}
    rounds.evaluate(3, [_eval(7, "book", **{"hr@10": 0.9}), _eval(8, "book"), _eval(9, "book")])
    assert rounds.final["book/hr@10"] == SCORES["hr@10"]  # the bound node's own numbers, not the impostor's
    assert sum("already evaluated by another node" in why for _, why in rounds.rejections) == 1
    assert any("evaluated as 'music' before" in why for _, why in rounds.rejections)
    rounds.evaluate(4, [_eval(8, "sport")])
    assert "the dataset's domains are ['book', 'music']" in rounds.rejections[-1][1]
    listed = _rounds(listed={8: 1, 9: 0})  # node 8 hosts music, node 9 book
    listed.evaluate(1, [_eval(8, "book"), _eval(9, "book")])
    assert listed.domain_of_node == {9: "book"} and "assigns this node 'music'" in listed.rejections[-1][1]


def test_value_bounds_come_from_the_models_scale():
    assert value_bounds(FPPDMServerConfig(), 1.0) == (MAX_ABS_MU, MAX_SIGMA) == (16.0, 17.0)
    assert value_bounds(FPPDMServerConfig(), 0.25) == (8.0, 9.0)  # they follow sqrt(margin)
    assert value_bounds(FPPDMServerConfig(max_abs_mu=7.0), 1.0) == (7.0, 17.0)  # an explicit bound wins
    rounds = _rounds()
    ids = np.array([0, 1])
    honest = frame_gaussians(ids, np.full((2, 2), 6.4), np.full((2, 2), 1.6))  # the largest measured honest values
    hostile = frame_gaussians(ids, np.full((2, 2), 1000.0), np.full((2, 2), 1000.0))
    out = rounds.train(1, [NodeReply(1, honest), NodeReply(2, hostile)], [], 0.0)
    assert out["accepted"] == 1 and "exceeds the bound 16" in rounds.rejections[-1][1]


@pytest.mark.parametrize("schedule", ["paper", "family"])
def test_honest_domains_pass_the_value_bounds_at_every_documented_setting(schedule):
    """A domain's model clamps its outputs to the run's value bounds, so the server never refuses an honest upload,
    however long or hard it trains. Synthetic pair shaped like the Amazon ones, trained the paper's way
    (batch 256, 5 local epochs) and the family schedule's way, then at a margin of 0.01 (bounds 1.6 / 2.6) with a
    large rate, where the model's unclamped outputs go past the bounds (they would have been refused): every upload
    is accepted, and a hostile one just past the bound is still refused."""
    from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer

    # shaped like the Amazon pairs: two domains, more items than users, sparse users, few shared
    ds = make_synthetic_multidomain(seed=3, num_domains=2, num_users=400, items_per_domain=600, mean_degree=6.0,
                                    overlap=0.3)
    cfg = load_config("fppdm", "synthetic-md3", [])
    f = cfg.fppdm
    training = {"paper": dataclasses.replace(f.training, batch_size=256, local_epochs=5),
                "family": f.training}[schedule]
    hard = dataclasses.replace(training, margin=0.01, lr=0.5)
    for tr in (training, hard):
        bound = value_bounds(f.server, tr.margin)
        rounds = FPPDMRounds(ds.num_users, dataclasses.replace(f.model, dim=8), f.server, SecureAggregationConfig(),
                             FederationConfig(rounds=1, eval_every=1, min_clients=1), margin=tr.margin)
        replies, peak = [], 0.0
        for k, domain in enumerate(ds.domains):
            trainer = DomainTrainer(DomainData(domain), k, dataclasses.replace(f.model, dim=8), tr, f.coclustering,
                                    0, value_bound=bound)
            trainer.train(1, np.zeros(0, np.int64), np.zeros((0, 8), np.float32), np.zeros((0, 8), np.float32))
            mu, sigma = trainer.user_distributions()
            with torch.no_grad():  # what the model's propagation reaches before its clamp
                peak = max(peak, float(trainer.model._propagate(trainer.model.mu).abs().max()))
            replies.append(NodeReply(k + 1, frame_gaussians(trainer.data.global_ids, mu, sigma)))
        out = rounds.train(1, replies, [], 0.0)
        assert out["accepted"] == 2, rounds.rejections
        if tr is hard:
            assert peak > bound[0]  # unclamped, this domain's upload would have been refused
    past = frame_gaussians(np.array([0]), np.full((1, 8), bound[0] * 1.001, np.float32), np.ones((1, 8), np.float32))
    rounds.train(2, [NodeReply(1, past)], [], 0.0)
    assert "exceeds the bound" in rounds.rejections[-1][1]


def test_uploads_without_users_do_not_count_toward_min_clients():
    rounds = _rounds()
    empty = frame_gaussians(np.zeros(0, np.int64), np.zeros((0, 2)), np.zeros((0, 2)))
    with pytest.raises(RuntimeError, match="no domain's upload was accepted, so the run cannot start: .*without users"):
        rounds.train(1, [NodeReply(1, empty), NodeReply(2, empty)], [], 0.0)
    later = _rounds()
    ok = frame_gaussians(np.array([0]), np.zeros((1, 2)), np.ones((1, 2)))
    later.train(1, [NodeReply(1, ok), NodeReply(2, ok)], [], 0.0)
    out = later.train(2, [NodeReply(1, ok), NodeReply(2, empty)], [], 0.0)
    assert out["accepted"] == 1 and out["applied"] is False  # min_clients = 2 counts domains that sent users


@pytest.fixture(scope="module")
def keys_512(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "k512.json"
    DomainKeys.generate(512).save(path)
    return path


def _client(tmp_path, key_file, key_bits):
    cfg = load_config("fppdm", "synthetic-md3", [f"output_dir={tmp_path}", "fppdm.model.dim=4",
                                                 "fppdm.secure.enabled=true", f"fppdm.secure.key_file={key_file}",
                                                 f"fppdm.secure.key_bits={key_bits}", "fppdm.training.local_epochs=1"])

    class Store:
        saved = None

        def load(self):
            return self.saved

        def save(self, arrays):
            self.saved = arrays

    return FPPDMDomainClient(cfg, make_synthetic_multidomain(seed=0).domains[0], 0, Store())


def test_a_key_of_another_size_than_key_bits_stops_the_domain_at_once(tmp_path, keys_512):
    with pytest.raises(ValueError, match="holds a 51[12]-bit Paillier key; fppdm.secure.key_bits = 1024"):
        _client(tmp_path, keys_512, 1024)


def test_every_decrypted_barycenter_is_checked_before_training(tmp_path, keys_512):
    """A hostile domain's ciphertexts (summed by the server, which cannot see them) decrypt to barycenters no
    honest uploads average to: the domain refuses those users' targets and trains the rest."""
    client = _client(tmp_path, keys_512, 512)
    ids = client.trainer.data.global_ids[:3].astype(np.int64)
    mu = np.array([[0.1] * 4, [100.0] * 4, [0.2] * 4], np.float32)  # user 2: far outside the bound
    sigma = np.array([[1.0] * 4, [1.0] * 4, [-63.4] * 4], np.float32)  # user 3: a negative standard deviation
    cts = encrypt_users(client.keys, client.packer, mu, sigma)
    download = frame_ciphertexts(ids, cts, np.ones(3, np.int64))
    kept, g_mu, g_sigma, refused = client._global_targets(download)
    assert refused == 2 and kept.tolist() == ids[:1].tolist() and np.allclose(g_mu, 0.1, atol=1e-4)
    _, _, metrics = client.fit(download, {"round": 1})
    assert metrics["refused_targets"] == 2
    with pytest.raises(ValueError, match="domain counts"):
        client._global_targets(frame_ciphertexts(ids, cts, np.zeros(3, np.int64)))


def test_domains_with_different_public_keys_stop_the_run_at_the_start(tmp_path, keys_512):
    other = tmp_path / "other.json"
    DomainKeys.generate(512).save(other)
    a, b = _client(tmp_path / "a", keys_512, 512), _client(tmp_path / "b", other, 512)
    secure = SecureAggregationConfig(enabled=True, key_bits=512)
    rounds = _rounds(num_users=make_synthetic_multidomain(seed=0).num_users, dim=4, secure=secure)
    uploads = []
    for node, client in ((1, a), (2, b)):
        arrays, _, _ = client.fit([], {"round": 1})
        uploads.append(NodeReply(node, arrays))
    with pytest.raises(RuntimeError, match="2 different Paillier public keys .* same fppdm.secure.key_file"):
        rounds.train(1, uploads, [], 0.0)
    assert public_n_array(a.keys).tobytes() != public_n_array(b.keys).tobytes()
