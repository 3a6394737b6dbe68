"""FedGNN protocol invariants: user multiplexing, node/user binding, determinism, resume, failures."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from flwr.app import RecordDict
from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays
from inprocess import OK, Manager, Proxy, drive

from clients.faults import with_faults
from clients.fedgnn import FedGNNClient
from clients.user_store import NodeStateStore, UserStateFiles
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.protocol import TRAIN_FIELDS, frame_users, split_users
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.reporting.results import RunRecorder
from strategies.fedgnn import FedGNNStrategy
from tests.conftest import TEST_SECRET

SMALL = ("federation.rounds=6", "federation.clients_per_round=12", "federation.eval_every=3", "model.dropout=0.2")


def _nodes(cfg, parts, per_node: int, first_id: int, files_root=None) -> dict:
    """Node id -> client hosting `per_node` consecutive users; node ids start at `first_id` (arbitrary)."""
    n = parts.meta.num_users
    nodes = {}
    for k, start in enumerate(range(0, n, per_node)):
        files = UserStateFiles(files_root) if files_root else None
        users = list(range(start, min(start + per_node, n)))
        client = FedGNNClient(cfg, parts.meta, users, parts.user, NodeStateStore(RecordDict(), files),
                              secret=TEST_SECRET)
        nodes[first_id + 7919 * k] = with_faults(client, cfg.faults, cfg.seed)
    return nodes


def _hosting(cfg, per_node: int):
    """cfg with simulation.users_per_node = per_node: the server accepts exactly those partition blocks."""
    cfg = copy.deepcopy(cfg)
    cfg.simulation.users_per_node = per_node
    return cfg


def _run(cfg, per_node: int, first_id: int = 10**6, **kw) -> FedGNNStrategy:
    cfg = _hosting(cfg, per_node)
    parts = UserPartitions(prepare_partitions(cfg.data))
    strategy = FedGNNStrategy(cfg, parts.meta.num_items, parts.meta.scale.midpoint,
                              RunRecorder(cfg.output_dir, "fedgnn", "synthetic", {}), parts.meta.num_users,
                              rating_span=4.0)
    drive(strategy, _nodes(cfg, parts, per_node, first_id, **kw))
    return strategy


def test_multiplexed_users_train_exactly_as_one_node_per_user(tiny_cfg):
    """Users sharing a node keep their own state and randomness: same numbers as one node each,
    whatever the node ids are (sampling goes by user id)."""
    cfg = tiny_cfg(*SMALL)
    one = _run(cfg, per_node=1, first_id=5)
    many = _run(cfg, per_node=7, first_id=123456)
    # a node of 7 batches its sampled users together, a node of 1 each alone: the same arithmetic summed in
    # other orders (float32 rounding, ~1e-7 relative per upload, tests/test_batched_users.py), not bitwise
    assert one.rounds.final["rmse"] == pytest.approx(many.rounds.final["rmse"], abs=1e-6)
    for a, b in zip(one.server.model_weights(), many.server.model_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    train = [r for r in many.recorder.history() if r.get("phase") == "train"]
    assert all(r["clients"] == 12 and r["accepted"] == 12 for r in train)
    assert many.recorder.history()[0]["nodes"] == -(-60 // 7)


def test_upload_for_a_user_the_node_does_not_host_is_rejected(tiny_cfg):
    cfg = _hosting(tiny_cfg(*SMALL), 30)
    parts = UserPartitions(prepare_partitions(cfg.data))
    strategy = FedGNNStrategy(cfg, parts.meta.num_items, parts.meta.scale.midpoint, None, parts.meta.num_users,
                              rating_span=4.0)
    nodes = _nodes(cfg, parts, 30, 1)
    honest, other = list(nodes)
    drive(strategy, nodes, last_round=1)  # registration
    before = strategy.server.model_weights()
    proxy, fit_ins = strategy.configure_fit(2, None, Manager(nodes))[0]
    node = proxy.node_id
    arrays, n, m = nodes[node].fit(parameters_to_ndarrays(fit_ins.parameters), fit_ins.config)
    liar = other if node == honest else honest  # the same upload, sent by a node that does not host those users
    strategy.aggregate_fit(2, [(Proxy(liar), FitRes(OK, ndarrays_to_parameters(arrays), n, m))], [])
    reasons = [why for _, why in strategy.rounds.rejections]
    assert len(reasons) == len(arrays[0]) and all("is not hosted by this node" in r for r in reasons)
    for a, b in zip(before, strategy.server.model_weights()):
        np.testing.assert_array_equal(a, b)  # nothing averaged in


def test_a_user_claimed_by_two_nodes_is_refused(tiny_cfg):
    cfg = _hosting(tiny_cfg(*SMALL), 60)
    parts = UserPartitions(prepare_partitions(cfg.data))
    strategy = FedGNNStrategy(cfg, parts.meta.num_items, parts.meta.scale.midpoint, None, parts.meta.num_users,
                              rating_span=4.0)
    nodes = _nodes(cfg, parts, 60, 1)
    # impostor
    nodes[2] = FedGNNClient(cfg, parts.meta, list(range(60)), parts.user, NodeStateStore(RecordDict()),
                            secret=TEST_SECRET)
    drive(strategy, nodes, last_round=1)
    assert strategy.bindings.node_of(0) in (1, 2) and len(strategy.server.anonymity_sets) == 60
    assert any("already registered by another node" in why for _, why in strategy.rounds.rejections)


def test_a_simulated_node_registers_exactly_its_partition_block(tiny_cfg):
    """A node claiming made-up ids, part of a block, or users across two blocks registers nobody."""
    cfg = _hosting(tiny_cfg(*SMALL), 10)
    parts = UserPartitions(prepare_partitions(cfg.data))
    strategy = FedGNNStrategy(cfg, parts.meta.num_items, parts.meta.scale.midpoint, None, parts.meta.num_users,
                              rating_span=4.0)
    nodes = {1: FedGNNClient(cfg, parts.meta, list(range(10)), parts.user, NodeStateStore(RecordDict()),
                             secret=TEST_SECRET)}
    for nid, users in ((2, [10, 11]), (3, list(range(15, 25))), (4, list(range(20, 30))), (5, list(range(30, 40))),
                       (6, list(range(40, 50)))):  # six nodes: enough for the 60 users at 10 each
        nodes[nid] = FedGNNClient(cfg, parts.meta, users, parts.user, NodeStateStore(RecordDict()), secret=TEST_SECRET)
    drive(strategy, nodes, last_round=1)
    assert sorted(strategy.server.anonymity_sets) == [*range(10), *range(20, 50)]
    refused = [why for _, why in strategy.rounds.rejections]
    assert len(refused) == 2 and all("hosts exactly users" in why for why in refused)


@pytest.mark.parametrize("server_opt", [(), ("server_opt.name=adam", "server_opt.lr_decay=0.8",
                                             "server_opt.item_beta1=0.99",
                                        "server_opt.item_weight_decay=1.0")])
def test_killed_and_resumed_run_ends_with_the_uninterrupted_metrics(tiny_cfg, tmp_path, server_opt):
    """Kill after Flower round 5 (checkpoint at training round 4), resume on fresh nodes with new ids.

    With Adam, a decaying rate and item weight decay the checkpoint must carry optimiser moments and the schedule
    too."""
    base = (*SMALL, "checkpoint.every=2", "simulation.users_per_node=5", *server_opt)
    clean = _run(tiny_cfg(*base, f"output_dir={tmp_path / 'clean'}"), 5, files_root=tmp_path / "clean-devices")
    cfg = tiny_cfg(*base, f"output_dir={tmp_path / 'killed'}")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    first = FedGNNStrategy(cfg, meta.num_items, meta.scale.midpoint, RunRecorder(cfg.output_dir, "fedgnn", "s", {}),
                           meta.num_users, rating_span=4.0)
    devices = tmp_path / "devices"
    drive(first, _nodes(cfg, parts, 5, 1, devices), last_round=6)  # register + 5 training rounds, then "killed"
    assert first.last_checkpoint == 5  # logical round 5 = training round 4
    resumed_cfg = tiny_cfg(*base, f"output_dir={tmp_path / 'killed'}", "checkpoint.resume=true")
    second = FedGNNStrategy(resumed_cfg, meta.num_items, meta.scale.midpoint,
                            RunRecorder(resumed_cfg.output_dir, "fedgnn", "s", {}), meta.num_users, rating_span=4.0)
    assert second.num_rounds == 1 + 2  # re-registration + training rounds 5 and 6
    drive(second, _nodes(resumed_cfg, parts, 5, 999, devices))  # new processes: node state starts empty
    assert second.rounds.final["rmse"] == pytest.approx(clean.rounds.final["rmse"], abs=1e-6)
    for a, b in zip(clean.server.model_weights(), second.server.model_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    rounds = [r["round"] for r in second.recorder.history() if r.get("phase") == "train"]
    assert rounds == [2, 3, 4, 5, 6, 7]  # history of the killed run, then the resumed rounds


def test_resume_refuses_a_checkpoint_from_another_config(tiny_cfg, tmp_path):
    _run(tiny_cfg(*SMALL, "checkpoint.every=3", f"output_dir={tmp_path}"), 30, files_root=tmp_path / "dev")
    cfg = tiny_cfg(*SMALL, "checkpoint.every=3", f"output_dir={tmp_path}", "checkpoint.resume=true", "model.dim=8")
    with pytest.raises(ValueError, match="different config .*'model'"):
        FedGNNStrategy(cfg, 80, 3.0, None, 60, rating_span=4.0)


def test_a_flwr_run_refuses_to_resume_from_an_in_process_checkpoint(tiny_cfg, tmp_path):
    """Its users' states are in the file, not on the devices: resumed by flwr, every user would start afresh."""
    from fedrec_flwr.cli.inprocess import run_in_process

    run_in_process(tiny_cfg(*SMALL, "checkpoint.every=3", f"output_dir={tmp_path}"), log_every=0)
    cfg = tiny_cfg(*SMALL, "checkpoint.every=3", f"output_dir={tmp_path}", "checkpoint.resume=true")
    with pytest.raises(ValueError, match="was written by an in-process run, whose users' states are in the file; "
                                         "resume it with fedrec run --in-process"):
        FedGNNStrategy(cfg, 80, 3.0, None, 60, rating_span=4.0)


def test_injected_crashes_and_malformed_uploads_do_not_stop_training(tiny_cfg):
    cfg = tiny_cfg(*SMALL, "faults.crash=0.2", "faults.malformed=0.1")
    strategy = _run(cfg, per_node=1)
    train = [r for r in strategy.recorder.history() if r.get("phase") == "train"]
    assert len(train) == 6 and np.isfinite(strategy.rounds.final["rmse"])
    failures = sum(r["failures"] for r in train)
    nan_rejections = [w for _, w in strategy.rounds.rejections if "NaN" in w]
    assert failures > 0 and nan_rejections  # both kinds happened and were logged
    assert all(r["accepted"] + r["rejected"] <= 12 for r in train)  # failures are counted among the rejected
    assert all(r["applied"] == (r["accepted"] >= cfg.federation.min_clients) for r in train)


def test_min_clients_policy_keeps_the_model_when_too_few_updates_arrive(tiny_cfg):
    cfg = tiny_cfg(*SMALL, "faults.crash=1.0")  # every sampled node crashes
    strategy = _run(cfg, per_node=4)
    train = [r for r in strategy.recorder.history() if r.get("phase") == "train"]
    assert all(not r["applied"] and r["accepted"] == 0 and r["failures"] > 0 for r in train)
    meta = UserPartitions(prepare_partitions(cfg.data)).meta
    untouched = FedGNNStrategy(cfg, meta.num_items, meta.scale.midpoint, None, meta.num_users, rating_span=4.0)
    for a, b in zip(untouched.server.model_weights(), strategy.server.model_weights()):
        np.testing.assert_array_equal(a, b)


def test_bias_vectors_are_learned_as_shared_model_weights(tiny_cfg):
    """model.biases adds two [d] model weights that pass validation, LDP and aggregation like the
    rest: every upload is accepted and both vectors leave their zero start."""
    cfg = tiny_cfg(*SMALL, "model.biases=true")
    strategy = _run(cfg, per_node=4)
    plain = _run(tiny_cfg(*SMALL), per_node=4)
    weights = strategy.server.model_weights()
    assert len(weights) == len(plain.server.model_weights()) + 2
    names = [n for n, _ in build_model(cfg.model, 3.0).named_parameters()]  # the order of the weight list
    user_bias, item_bias = weights[names.index("user_bias_map")], weights[names.index("item_bias_map")]
    assert user_bias.shape == item_bias.shape == (16,)
    assert np.abs(user_bias).max() > 0 and np.abs(item_bias).max() > 0
    train = [r for r in strategy.recorder.history() if r.get("phase") == "train"]
    assert all(r["accepted"] == 12 and r["rejected"] == 0 for r in train)
    assert np.isfinite(strategy.rounds.final["rmse"])


def test_undecodable_uploads_and_unsampled_users_are_rejected_not_fatal(tiny_cfg):
    """A node that sends pickled objects, or uploads for a user it hosts but nobody sampled, is
    refused and counted; the round goes on with the honest nodes."""
    from flwr.common import Parameters

    cfg = _hosting(tiny_cfg(*SMALL, "federation.clients_per_round=4"), 30)
    parts = UserPartitions(prepare_partitions(cfg.data))
    strategy = FedGNNStrategy(cfg, parts.meta.num_items, parts.meta.scale.midpoint, None, parts.meta.num_users,
                              rating_span=4.0)
    nodes = _nodes(cfg, parts, 30, 1)
    drive(strategy, nodes, last_round=1)
    (proxy, fit_ins), *_ = strategy.configure_fit(2, None, Manager(nodes))
    arrays, n, m = nodes[proxy.node_id].fit(parameters_to_ndarrays(fit_ins.parameters), fit_ins.config)
    sampled = set(arrays[0].tolist())
    other = next(u for u in strategy.bindings.live_users({proxy.node_id}) if u not in sampled)
    parts = split_users(arrays, TRAIN_FIELDS)
    # a copy as `other`
    forged = frame_users([*(u for u, _ in parts), other], [*(p for _, p in parts), parts[0][1]], TRAIN_FIELDS)
    garbage = Parameters(tensors=[b"\x80\x04not an array"], tensor_type="numpy.ndarray")
    results = [(Proxy(proxy.node_id), FitRes(OK, ndarrays_to_parameters(forged), n, m)),
               (Proxy(999), FitRes(OK, garbage, 1, {}))]
    _, metrics = strategy.aggregate_fit(2, results, [])
    reasons = [why for _, why in strategy.rounds.rejections]
    assert any(f"user {other} was not sampled in round 2" in r for r in reasons)
    assert any("node 999: undecodable upload" in r for r in reasons)
    assert metrics["accepted"] == len(sampled) and metrics["applied"] == 1  # the honest users still count


def test_a_nodes_state_keeps_each_users_state_exactly_and_refuses_damaged_bytes():
    from fedrec_flwr.fedgnn.state import UserState, decode_state, encode_state

    rng = np.random.default_rng(0)
    st = UserState(rng.random(8, dtype=np.float32), np.array([1, 5, 9]), rng.random((3, 8), dtype=np.float32),
                   "0f" * 16, -0.375)
    store = NodeStateStore(RecordDict())
    store.save(4, st)
    back = store.load(4)
    for a, b in ((back.embedding, st.embedding), (back.anonymity_ids, st.anonymity_ids),
                 (back.neighbours, st.neighbours)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert (back.handle, back.offset) == (st.handle, st.offset) and store.load(5) is None
    blob = encode_state(st)
    negative = np.array([-1, 3, 3, 8, 16], "<i8").tobytes() + blob[40:]
    zero_width = np.array([0, 0, 2**60, 0, 0], "<i8").tobytes() + np.float64(0).tobytes()  # 2**60 rows of nothing
    for damaged in (blob[:-1], blob + b"\0", b"", blob[:30], negative, zero_width):
        with pytest.raises(ValueError, match="stored user state"):
            decode_state(damaged)
