"""Hostile clients and files: what the FedGNN round core and the checkpointer refuse, and what they keep."""

from __future__ import annotations

import pickle
import re
import time

import numpy as np
import pytest
import torch

from fedrec_flwr.fedgnn.bindings import NodeBindings
from fedrec_flwr.fedgnn.bounds import (
    FALSE_REJECTION,
    PER_CHECK,
    check_upload_bounds,
    ldp_coordinate_bound,
    ldp_l1_bound,
)
from fedrec_flwr.fedgnn.checkpoint import Checkpointer, CheckpointError
from fedrec_flwr.fedgnn.protocol import frame_registration, frame_train_upload, frame_users
from fedrec_flwr.fedgnn.rounds import FedGNNRounds
from fedrec_flwr.fedgnn.server import FedGNNServer, robust_location, validate_upload
from fedrec_flwr.messages import NodeReply, UploadRejected
from fedrec_flwr.privacy import privatize


def test_honest_ldp_uploads_pass_and_out_of_range_ones_are_refused(tiny_cfg):
    cfg = tiny_cfg()  # the paper's LDP: clip 0.1, Laplace 0.2
    rng = np.random.default_rng(0)
    coordinates = 2000
    bound = ldp_coordinate_bound(cfg.privacy.clip_delta, cfg.privacy.noise_lambda, coordinates, PER_CHECK)
    assert bound == pytest.approx(0.1 + 0.2 * np.log(coordinates / PER_CHECK)) and PER_CHECK * 3 == FALSE_REJECTION
    for _ in range(3000):  # honest: clipped gradients of any size, then Laplace noise
        upload = privatize([rng.normal(0, 5, coordinates).astype(np.float32)], 0.1, 0.2, rng)
        check_upload_bounds(cfg.privacy, cfg.merge, upload)
    poisoned = [np.full(coordinates, 50.0, np.float32), np.full(coordinates, bound * 1.01, np.float32),
                np.r_[np.zeros(coordinates - 1), -bound * 1.5].astype(np.float32),
                np.full(coordinates, 1e30, np.float32)]
    for upload in poisoned:
        with pytest.raises(UploadRejected, match="exceeds the LDP bound"):
            check_upload_bounds(cfg.privacy, cfg.merge, [upload])


def test_an_upload_must_have_the_l1_norm_of_clip_plus_laplace(tiny_cfg):
    """Every coordinate inside the coordinate bound is not enough: each block's L1 norm must be one that clipped
    values plus Laplace noise reach. Honest blocks at the worst case (every clipped value at +delta) pass, the
    coordinated at-bound attack is refused, and a block at the L1 limit (the strongest passing attacker) passes."""
    cfg = tiny_cfg()
    p = cfg.privacy
    rng = np.random.default_rng(1)
    sizes = (1500, 500)  # model gradients, item rows
    margins = []
    for _ in range(2000):  # honest, worst case for the norm: every gradient clipped to +delta, then noise
        model, rows = privatize([np.full(sizes[0], 9.0, np.float32), np.full(sizes[1], 9.0, np.float32)], 0.1, 0.2, rng)
        check_upload_bounds(p, cfg.merge, [model, rows])
        margins.append(np.abs(model).sum() / ldp_l1_bound(0.1, 0.2, sizes[0], PER_CHECK))
    # every honest draw passes (the checks above), and the limit is tight: honest norms reach ~90% of it
    assert 0.85 < float(np.mean(margins)) and max(margins) < 1.0
    at_bound = 0.999 * ldp_coordinate_bound(0.1, 0.2, sum(sizes), PER_CHECK)
    with pytest.raises(UploadRejected, match="model gradients: L1 norm"):
        check_upload_bounds(p, cfg.merge, [np.full(sizes[0], at_bound, np.float32), np.zeros(sizes[1], np.float32)])
    with pytest.raises(UploadRejected, match="item rows: L1 norm"):
        check_upload_bounds(p, cfg.merge, [np.zeros(sizes[0], np.float32), np.full(sizes[1], -at_bound, np.float32)])
    strongest = [np.full(n, 0.999 * ldp_l1_bound(0.1, 0.2, n, PER_CHECK) / n, np.float32) for n in sizes]
    check_upload_bounds(p, cfg.merge, strongest)
    assert 0.221 < float(strongest[0][0]) < 0.26  # the honest mean |coordinate|, 0.221, plus the Chernoff margin


def test_the_l1_bound_is_a_chernoff_bound_at_the_worst_clipped_value():
    """The moment generating function of |x + Laplace| grows with |x| (so |x| = delta is the worst case the bound
    assumes), matches a Monte Carlo estimate, and the bound sits above the honest mean by a shrinking margin."""
    from fedrec_flwr.fedgnn.bounds import abs_laplace_mgf

    for s in np.linspace(0.05, 4.95, 50):
        values = [abs_laplace_mgf(s, a, 0.2) for a in np.linspace(0.0, 0.1, 51)]
        assert np.all(np.diff(values) >= -1e-12), s
    noise = np.random.default_rng(0).laplace(0.0, 0.2, 1_000_000)
    for s in (0.5, 2.0):
        assert abs_laplace_mgf(s, 0.1, 0.2) == pytest.approx(np.mean(np.exp(s * np.abs(0.1 + noise))), rel=2e-3)
    mean = 0.1 + 0.2 * np.exp(-0.5)
    per = [ldp_l1_bound(0.1, 0.2, c, PER_CHECK) / c for c in (1000, 100_000, 1_000_000)]
    assert mean < per[2] < per[1] < per[0] < mean + 0.05


def test_without_ldp_the_operator_norm_bound_applies(tiny_cfg):
    cfg = tiny_cfg("privacy.ldp=false", "merge.upload_norm_bound=10")
    check_upload_bounds(cfg.privacy, cfg.merge, [np.full(16, 2.0, np.float32)])  # norm 8
    with pytest.raises(UploadRejected, match="upload_norm_bound"):
        check_upload_bounds(cfg.privacy, cfg.merge, [np.full(16, 3.0, np.float32)])  # norm 12
    with pytest.raises(UploadRejected, match="model gradients: L2 norm"):  # per block: each within the bound
        check_upload_bounds(cfg.privacy, cfg.merge, [np.full(16, 3.0, np.float32), np.full(16, 2.0, np.float32)])
    check_upload_bounds(cfg.privacy, cfg.merge, [np.full(16, 2.0, np.float32), np.full(16, 2.0, np.float32)])
    # 0: no bound set
    check_upload_bounds(tiny_cfg("privacy.ldp=false").privacy, tiny_cfg("privacy.ldp=false").merge,
                        [np.full(16, 1e6, np.float32)])


SHAPES = [(3, 2), ()]


def _upload(scale=1.0, dtype=np.float32):
    return [np.full((3, 2), scale, dtype), np.asarray(0.5 * scale, dtype), np.array([1, 4, 7]),
            np.full((3, 4), scale, dtype)]


@pytest.mark.parametrize("value,dtype", [(1e300, np.float64), (np.inf, np.float32), (np.nan, np.float64),
                                         (1e30, np.float32)])
def test_values_that_break_float32_arithmetic_are_refused_after_the_cast(value, dtype):
    """1e300 is finite as float64 but inf as float32; 1e30 squares (Adam's moment) to inf in float32."""
    with pytest.raises(UploadRejected, match="NaN/Inf or values too large"):
        validate_upload(_upload(value, dtype), SHAPES, 4, 10, 3, None)
    grads, _, rows = validate_upload(_upload(2.0, np.float64), SHAPES, 4, 10, 3, None)
    assert all(g.dtype == np.float32 for g in grads) and rows.dtype == np.float32


def test_integer_arrays_are_refused_as_gradients():
    with pytest.raises(UploadRejected, match="expected a float dtype"):
        validate_upload([np.ones((3, 2), np.int64), *_upload()[1:]], SHAPES, 4, 10, 3, None)


def test_registration_refuses_ids_outside_the_dataset_and_second_claims():
    bindings = NodeBindings(num_users=10)
    bindings.check_claim(1, [0, 9])
    bindings.bind(1, [0, 9])
    for users, why in (([10], "outside the dataset"), ([-1], "outside the dataset"), ([9], "already registered")):
        with pytest.raises(UploadRejected, match=why):
            bindings.check_claim(2, users)
    entitled = NodeBindings(10, entitled=lambda node: range(node * 5, node * 5 + 5))
    entitled.check_claim(1, [5, 9])
    with pytest.raises(UploadRejected, match="not assigned to node 1"):
        entitled.check_claim(1, [4])


def _rounds(cfg, num_users=4, num_items=20, set_size=20, test_count=2):
    """A round core whose users registered through its own registration round, node 100 + u hosting user u,
    each committing `test_count` test ratings."""
    server = FedGNNServer.from_config(cfg, num_items, 3.0)
    rounds = FedGNNRounds.from_config(cfg, server, NodeBindings(num_users), rating_span=4.0)
    rounds.register(1, [NodeReply(100 + u, frame_registration([u], [np.arange(set_size)], [test_count]))
                        for u in range(num_users)], time.time())
    assert not rounds.rejections
    return rounds


@pytest.mark.parametrize("metrics,why", [
    ({"sse": float("nan"), "sae": 1.0, "n": 2}, "finite"),
    ({"sse": -1.0, "sae": 1.0, "n": 2}, "finite and >= 0"),
    ({"sse": 1.0, "sae": 1.0, "n": 20}, "committed 2 test ratings"),  # n = its anonymity set: the old spoof
    ({"sse": 0.0, "sae": 0.0, "n": 1}, "committed 2 test ratings"),
    ({"sse": 1.0, "sae": 1.0, "n": -3}, "non-negative integer"),
    ({"sse": 1.0, "sae": 1.0, "n": 2.5}, "non-negative integer"),
    ({"sse": 33.0, "sae": 1.0, "n": 2}, "exceed what 2 ratings"),  # 2 ratings can err by at most 2 * 4^2
    ({"sse": "lots", "sae": 1.0, "n": 2}, "numeric sse"),
    ({"sae": 1.0, "n": 2}, "numeric sse"),
])
def test_dishonest_evaluation_replies_are_refused_and_counted(tiny_cfg, metrics, why):
    rounds = _rounds(tiny_cfg())
    honest = [NodeReply(100 + u, metrics={"sse": 2.0, "sae": 2.0, "n": 2}) for u in range(3)]
    out = rounds.evaluate(rounds.plan_eval(5, set(rounds.bindings.nodes)), [*honest, NodeReply(103, metrics=metrics)],
                          failures=0)
    assert out["rmse"] == pytest.approx(1.0) and out["eval_ratings"] == 6  # the honest nodes alone
    assert rounds.eval_rejections == 1 and why in rounds.rejections[-1][1]


def test_one_node_moves_the_rmse_by_at_most_its_committed_share(tiny_cfg):
    """A node can report any SSE its users' committed test ratings allow, and no more ratings than committed:
    its reply moves the RMSE only within the interval its share spans (SSE from 0 to n x span^2)."""
    rounds = _rounds(tiny_cfg(), num_users=10, test_count=5)
    honest = [NodeReply(100 + u, metrics={"sse": 5.0, "sae": 5.0, "n": 5}) for u in range(10)]
    clean = rounds.evaluate(rounds.plan_eval(5, set(rounds.bindings.nodes)), honest, failures=0)["rmse"]
    total_sse, total_n, share = 50.0, 50, 5
    low, high = np.sqrt((total_sse - 5.0) / total_n), np.sqrt((total_sse - 5.0 + share * 16.0) / total_n)
    for sse in (0.0, share * 16.0):  # the best and the worst a node of 5 ratings can claim
        spoofed = [*honest[:9], NodeReply(109, metrics={"sse": sse, "sae": 0.0, "n": share})]
        rmse = rounds.evaluate(rounds.plan_eval(5, set(rounds.bindings.nodes)), spoofed, failures=0)["rmse"]
        assert low - 1e-12 <= rmse <= high + 1e-12 and rmse != clean
    inflated = [*honest[:9], NodeReply(109, metrics={"sse": 0.0, "sae": 0.0, "n": 20})]  # claims its set's size
    # refused: the other nine alone
    assert rounds.evaluate(rounds.plan_eval(5, set(rounds.bindings.nodes)), inflated, failures=0)["eval_ratings"] == 45


def test_a_registration_commits_a_test_count_within_its_set(tiny_cfg):
    rounds = _rounds(tiny_cfg(), num_users=2)
    fresh = FedGNNRounds.from_config(tiny_cfg(), rounds.server, NodeBindings(4), rating_span=4.0)
    for count, why in ((21, r"expected one integer in \[0, 20\]"), (-1, "expected one integer")):
        fresh.register(1, [NodeReply(50, frame_registration([3], [np.arange(20)], [count]))], time.time())
        assert re.search(why, fresh.rejections[-1][1]) and 3 not in fresh.test_counts
    one_field = frame_users([3], [[np.arange(20)]], 1)  # no count: refused, not guessed
    fresh.register(1, [NodeReply(50, one_field)], time.time())
    assert "message must have 5 arrays" in fresh.rejections[-1][1]


def test_evaluation_from_a_node_not_asked_is_refused(tiny_cfg):
    rounds = _rounds(tiny_cfg())
    out = rounds.evaluate(rounds.plan_eval(5, set(rounds.bindings.nodes)), [NodeReply(100, metrics={"sse": 2.0,
                                                                                                    "sae": 2.0,
                                                                                                    "n": 2}),
                              NodeReply(999, metrics={"sse": 0.0, "sae": 0.0, "n": 1000})], failures=0)
    assert out["eval_ratings"] == 2 and "not asked to evaluate" in rounds.rejections[-1][1]


def test_an_evaluation_reply_claiming_more_absolute_error_than_its_ratings_allow_is_refused(tiny_cfg):
    """The reported MAE is only as honest as each node's SAE: n ratings on a scale of range 4 err by at most 4 each,
    so a node of 2 test ratings can report SAE <= 8 (its worst honest case passes) and SAE 9 is refused, counted,
    and left out of the MAE and RMSE, whatever (in-bound) SSE it sends with it."""
    rounds = _rounds(tiny_cfg())
    honest = [NodeReply(100 + u, metrics={"sse": 2.0, "sae": 2.0, "n": 2}) for u in range(3)]  # each error 1
    worst = rounds.evaluate(rounds.plan_eval(5, set(rounds.bindings.nodes)),
                            [*honest, NodeReply(103, metrics={"sse": 32.0, "sae": 8.0, "n": 2})], failures=0)
    assert rounds.eval_rejections == 0 and worst["eval_ratings"] == 8
    assert worst["mae"] == pytest.approx((6.0 + 8.0) / 8)  # both errors at the full range: still a possible reply
    for sae in (9.0, 1e6):
        hostile = NodeReply(103, metrics={"sse": 2.0, "sae": sae, "n": 2})
        out = rounds.evaluate(rounds.plan_eval(6, set(rounds.bindings.nodes)), [*honest, hostile], failures=0)
        assert out["eval_ratings"] == 6 and out["mae"] == pytest.approx(1.0) and out["rmse"] == pytest.approx(1.0)
        assert rounds.rejections[-1][0] == 6 and "exceed what 2 ratings" in rounds.rejections[-1][1]
    assert rounds.eval_rejections == 2


@pytest.mark.parametrize("users_per_node", [1, 3])
def test_eval_fraction_asks_a_fixed_sample_of_that_share_of_the_users(tiny_cfg, users_per_node):
    """federation.eval_fraction < 1 scores the model on round(fraction x users) users (at least one), the same
    sample every evaluation round, and asks only the nodes hosting them; 1 asks every registered user's node."""
    num_users = 24
    nodes = {u: 100 + u // users_per_node for u in range(num_users)}

    def plan(fraction: float) -> dict[int, list[int]]:
        cfg = tiny_cfg(f"federation.eval_fraction={fraction}")
        server = FedGNNServer.from_config(cfg, 20, 3.0)
        rounds = FedGNNRounds.from_config(cfg, server, NodeBindings(num_users), rating_span=4.0)
        hosted: dict[int, list[int]] = {}
        for u, node in nodes.items():
            hosted.setdefault(node, []).append(u)
        rounds.register(1, [NodeReply(node, frame_registration(users, [np.arange(20)] * len(users), [2] * len(users)))
                            for node, users in hosted.items()], time.time())
        assert not rounds.rejections and len(rounds.test_counts) == num_users
        first = rounds.plan_eval(5, set(hosted)).nodes
        # a fixed sample: every evaluation round asks the same users
        assert rounds.plan_eval(5, set(hosted)).nodes == first
        return first

    everyone = plan(1.0)
    assert sorted(u for users in everyone.values() for u in users) == list(range(num_users))
    assert set(everyone) == set(nodes.values())
    for fraction, expected in ((0.25, 6), (0.5, 12), (0.01, 1)):
        sampled = plan(fraction)
        users = sorted(u for group in sampled.values() for u in group)
        assert len(users) == expected and len(set(users)) == expected and set(users) <= set(range(num_users))
        assert set(sampled) == {nodes[u] for u in users}  # exactly the nodes hosting the sample
        assert all(nodes[u] == node for node, group in sampled.items() for u in group)


def test_robust_location_resists_a_poisoned_minority():
    honest = np.random.default_rng(1).normal(0, 0.1, size=(9, 5))
    stack = np.concatenate([honest, np.full((1, 5), 1e6)])
    assert np.abs(robust_location(stack, "median", 0.1)).max() < 0.3
    assert np.abs(robust_location(stack, "trimmed", 0.1)).max() < 0.3
    assert robust_location(stack, "mean", 0.1).min() > 1e4
    np.testing.assert_allclose(robust_location(honest, "trimmed", 0.0), honest.mean(0))
    with_missing = np.array([[1.0, np.nan], [3.0, 2.0], [100.0, np.nan]])
    np.testing.assert_allclose(robust_location(with_missing, "median", 0.0), [3.0, 2.0])


def test_a_robust_merge_round_ignores_one_scaled_upload(tiny_cfg):
    """One user sends a huge (unbounded: LDP off) gradient; the median merge moves the model as the honest ones do."""
    cfg = tiny_cfg("privacy.ldp=false", "merge.robust=median", "federation.min_clients=1")
    rounds = _rounds(cfg)
    shapes = rounds.server.model_shapes
    rng = np.random.default_rng(0)
    before = rounds.server.model_weights()

    def part(u, scale):
        return [*(rng.normal(0, 0.01, s).astype(np.float32) * scale for s in shapes), np.arange(20),
                (rng.normal(0, 0.01, (20, cfg.model.dim)) * scale).astype(np.float32)]

    plan = rounds.plan_train(2, {100 + u for u in range(4)})  # all four are sampled (128 per round)
    replies = [NodeReply(100 + u, frame_train_upload([u], [part(u, 1e4 if u == 3 else 1.0)])) for u in range(4)]
    rounds.train(plan, replies, [], time.time(), 0.0)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(before, rounds.server.model_weights()))
    assert 0 < moved < 0.05  # SGD lr 0.01 on a median gradient of size ~0.01


def test_a_reply_naming_more_users_than_its_node_hosts_costs_one_rejection(tiny_cfg):
    """A few bytes of invented user ids (sizes 0, empty blocks) must not buy a rejection record per id."""
    cfg = tiny_cfg()
    rounds = _rounds(cfg)
    plan = rounds.plan_train(2, {100 + u for u in range(4)})
    many = 100_000
    ids, zeros = np.arange(many), np.zeros(many, np.int64)
    forged = [ids, zeros, np.zeros(0, np.float32), zeros, np.zeros(0, np.int64), zeros,
              np.zeros((0, cfg.model.dim), np.float32)]
    rounds.train(plan, [NodeReply(100, forged)], [], time.time(), 0.0)
    assert [why for _, why in rounds.rejections] == ["node 100: message names 100000 users; the node may speak "
                                                     "for at most 1"]
    popular = FedGNNRounds.from_config(tiny_cfg("simulation.users_per_node=5"), rounds.server,
                                       NodeBindings(40, block_size=5), rating_span=4.0)
    popular.register(1, [NodeReply(7, frame_registration(list(range(6)), [np.arange(20)] * 6, [2] * 6))], time.time())
    assert "names 6 users; the node may speak for at most 5" in popular.rejections[-1][1]
    from fedrec_flwr.fedgnn.bindings import listed

    operator = FedGNNRounds.from_config(cfg, rounds.server, NodeBindings(40, listed({3: frozenset([0])})),
                                        rating_span=4.0)
    operator.register(1, [NodeReply(9, frame_registration([0], [np.arange(20)], [2]))], time.time())  # an unlisted node
    assert "user 0 is not assigned to node 9" in operator.rejections[-1][1]  # told why, not only how many


def test_checkpoints_load_without_running_code(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()

    class Exploit:
        def __reduce__(self):
            return (exec, ("open(%r, 'w').write('pwned')" % str(tmp_path / "pwned"),))

    (folder / "server.pt").write_bytes(pickle.dumps({"model": Exploit()}))
    with pytest.raises(CheckpointError, match="server.pt: not a readable FedGNN checkpoint"):
        Checkpointer(folder).load()
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "foreign"])
def test_damaged_or_foreign_checkpoints_name_the_file(tmp_path, damage):
    ckpt = Checkpointer(tmp_path)
    full = {"model": {"w": torch.ones(3)}, "items": torch.ones(2, 2), "model_opt": {}, "item_opt": {},
            "torch_rng": torch.get_rng_state(), "logical_round": 3, "train_rounds_done": 2, "rounds_not_applied": 0,
            "history": [], "rejections": [], "uploads": [0, 1], "eval_rejected": 0, "config": {}}
    ckpt.save(full)
    assert ckpt.load()["logical_round"] == 3
    if damage == "empty":
        ckpt.path.write_bytes(b"")
    elif damage == "truncated":
        ckpt.path.write_bytes(ckpt.path.read_bytes()[:100])
    else:
        ckpt.save({"weights": torch.ones(2)})
    with pytest.raises(CheckpointError, match=str(ckpt.path)):
        ckpt.load()


def test_the_operators_node_list_binds_users_and_domains(tmp_path, tiny_cfg):
    from fedrec_flwr.fedgnn.bindings import bindings_for
    from fedrec_flwr.fppdm.rounds import FPPDMRounds
    from fedrec_flwr.node_list import NodeListError, load_node_list

    path = tmp_path / "nodes.json"
    path.write_text('{"11": [0, 1], "12": [2]}')
    cfg = tiny_cfg(f"deployment.node_list={path}")
    bindings = bindings_for(3, cfg.deployment, cfg.data.catalogue, cfg.simulation.users_per_node)
    bindings.check_claim(11, [0, 1])
    for node, users in ((12, [0]), (13, [2])):
        with pytest.raises(UploadRejected, match=f"not assigned to node {node}"):
            bindings.check_claim(node, users)
    rounds = FPPDMRounds.from_config(cfg, num_users=5, num_domains=3)
    assert rounds.validate_reply(1, NodeReply(13, [np.zeros(0)])) is None
    assert "not a domain of deployment.node_list" in rounds.rejections[-1][1]
    for text, why in (('{"1": [0], "2": [0]}', "listed for nodes 1 and 2"), ('{"1": [7]}', "outside \\[0, 3\\)"),
                      ('[1, 2]', "expected a JSON object")):
        path.write_text(text)
        with pytest.raises(NodeListError, match=why):
            load_node_list(path, 3)
