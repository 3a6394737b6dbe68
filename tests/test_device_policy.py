"""A device enforces its own privacy limits under user-level DP, whatever the server asks (`clients.privacy_guard`).

The guard is driven here stage by stage with the messages a (possibly malicious) server's SecAgg+ workflow sends;
`call_next` stands in for Flower's `secaggplus_mod` and the client behind it, and records whether it was reached."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import Context, Message, Metadata
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage

from clients.privacy_guard import FIT_CONFIG, DeviceTerms, load_ledger, privacy_guard
from fedrec_flwr.fedgnn.accounting import UserDPAccountant, calibrate_noise_multiplier
from fedrec_flwr.fedgnn.device_policy import (
    DevicePolicy,
    DevicePolicyError,
    PolicyRefusal,
    charged_multiplier,
    floor_nodes,
)
from fedrec_flwr.fedgnn.rounds import FedGNNRounds

OWN = 5


def _message(stage: str | None, phase: str = "train", **configs) -> Message:
    """A training message of the SecAgg+ `stage` (None: a plain one), its fit config saying `phase`."""
    metadata = Metadata(1, str(stage), 0, OWN, "", "", time.time(), 600.0, MessageType.TRAIN)
    content = RecordDict({FIT_CONFIG: ConfigRecord({"phase": phase, "round": 2})})
    if stage is not None:
        content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({Key.STAGE: stage, **configs})
    return Message(metadata=metadata, content=content)


def _paper_run(tmp_path, overrides: str = "") -> dict:
    """The run config of a `fedgnn_paper` run on synthetic data, as a server would send it."""
    return {"preset": "fedgnn_paper", "dataset": "synthetic", "data-dir": str(tmp_path), "seed": 0,
            "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path / "out"), "set": overrides}


def _recorder():
    """(seen, call_next): a ClientApp stand-in that records every message a mod lets through."""
    seen = []

    def call_next(msg, context):
        seen.append(msg)
        return msg

    return seen, call_next


def _setup(n: int, threshold: int, terms: DeviceTerms, **changed) -> Message:
    honest = {Key.SHARE_NUMBER: n, Key.SAMPLE_NUMBER: n, Key.THRESHOLD: threshold, Key.MAX_WEIGHT: 1.0,
              Key.MOD_RANGE: 2**32, Key.CLIPPING_RANGE: terms.clipping_range,
              Key.TARGET_RANGE: terms.quantization_range}
    return _message(Stage.SETUP, **{**honest, **changed})


class Device:
    """One node behind the guard: `call_next` answers every stage and notes which stages reached it."""

    def __init__(self, terms: DeviceTerms):
        self.context = Context(1, OWN, {"partition-id": 0}, RecordDict(), {})
        self.terms = terms
        self.mod = privacy_guard(lambda context: terms)
        self.reached: list[str] = []

    def call_next(self, msg: Message, context: Context) -> Message:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        stage = "plain" if configs is None else str(configs[Key.STAGE])
        self.reached.append(stage)
        meta = msg.metadata
        return Message(metadata=Metadata(1, "reply", OWN, 0, meta.message_id, "", time.time(), 600.0,
                                         meta.message_type), content=RecordDict())

    def secure_round(self, nodes: list[int], threshold: int, active: list[int], unmask: bool = True) -> bool:
        """One SecAgg+ round among `nodes` with the `active` ones left at unmasking; True if the device released its
        shares (the sum could be unmasked), False if it refused at some stage. `unmask` False: the server never
        sends this device the unmask stage (it unmasks the sum with the other nodes' shares)."""
        n = len(nodes)
        self.reached.clear()
        self.context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(
            {"nid": OWN, "threshold": threshold, "rd_seed_share_dict:K": list(nodes),
             "rd_seed_share_dict:V": [b"s"] * n})
        stages = [
            _setup(n, threshold, self.terms),
            _message(Stage.SHARE_KEYS, **{str(nid): [b"pk1", b"pk2"] for nid in nodes}),
            _message(Stage.COLLECT_MASKED_VECTORS, **{Key.CIPHERTEXT_LIST: [b"c"] * (n - 1),
                                                      Key.SOURCE_LIST: [x for x in nodes if x != OWN]}),
            _message(Stage.UNMASK, **{Key.ACTIVE_NODE_ID_LIST: list(active),
                                      Key.DEAD_NODE_ID_LIST: [x for x in nodes if x not in active]}),
        ][: 4 if unmask else 3]
        try:
            for msg in stages:
                self.mod(msg, self.context, self.call_next)
        except PolicyRefusal:
            return False
        return True


def _terms(policy: DevicePolicy, q: float, sigma: float, floor: int, clip: float = 1.0) -> DeviceTerms:
    return DeviceTerms(policy, q, sigma, clip, floor, clip + 8 * sigma * clip / math.sqrt(floor), 2**24)


def test_no_dropout_takes_a_device_past_its_budget_and_its_ledger_agrees_with_the_servers():
    """60 one-user nodes, noise floor K = 48. The server keeps asking for rounds (three times what the budget
    allows). The device charges each round in full before its masked vector leaves, then, at unmasking, what the
    sum of the k active shares carries. With random dropouts before unmasking it never lets a sum of fewer than K
    nodes through (it stays charged in full for those), never passes its target, and sits out once one more round
    would; on an honest run (no dropouts) its ledger equals the server's round for round."""
    nodes, q, target, planned = list(range(1, 61)), 20 / 60, 4.0, 30
    sigma = calibrate_noise_multiplier(q, planned, target, 1e-5)
    privacy = SimpleNamespace(target_epsilon=target, delta=1e-5, clip_norm=1.0, min_node_fraction=0.8)
    policy = DevicePolicy.from_run(privacy, sigma)
    floor = policy.floor_nodes(len(nodes))
    assert floor == 48
    rng = np.random.default_rng(0)
    for dropouts in (True, False):
        terms = _terms(policy, q, sigma, floor)
        device = Device(terms)
        server = UserDPAccountant(60, q, sigma, 1.0, 1e-5, target)
        released = refused_small = 0
        for _ in range(3 * planned):
            k = int(rng.integers(40, 61)) if dropouts else 60  # nodes that drop after sending their masked vectors
            active = [OWN, *rng.choice([x for x in nodes if x != OWN], k - 1, replace=False).tolist()]
            if device.secure_round(nodes, math.ceil(0.7 * 60), active):
                released += 1
                server.record_round(charged_multiplier(sigma, k, floor))
                assert k >= floor
            elif k < floor and Stage.COLLECT_MASKED_VECTORS in device.reached:
                refused_small += 1
                assert Stage.UNMASK not in device.reached  # its shares never reached the server
            spent = load_ledger(device.context, terms).epsilon(1e-5)
            assert server.epsilon() - 1e-9 <= spent <= target * (1 + 1e-9)
            if not dropouts:
                assert spent == pytest.approx(server.epsilon(), rel=1e-9, abs=1e-12)
        # all report: sigma sqrt(60/48) a round, so more rounds than planned fit; with dropouts the rounds refused at
        # unmasking stay charged in full, so fewer do
        assert 0 < released < 3 * planned and (released >= planned or dropouts)
        assert (refused_small > 0) == dropouts


def test_a_device_the_server_never_asks_to_unmask_stays_charged_in_full():
    """The server can unmask the sum with the other nodes' shares alone; the device was charged at sigma (as if at
    the floor) before its masked vector left, so skipping its unmask stage saves the server nothing."""
    sigma = 1.0
    policy = DevicePolicy.from_run(SimpleNamespace(target_epsilon=8.0, delta=1e-5, clip_norm=1.0,
                                                   min_node_fraction=0.8), sigma)
    terms = _terms(policy, 0.1, sigma, 10)
    device = Device(terms)
    nodes = list(range(1, 13))
    assert device.secure_round(nodes, 9, nodes, unmask=False)
    ledger = load_ledger(device.context, terms)
    assert ledger.rounds == {(0.1, 1.0): 1}  # the full charge, not sigma sqrt(12 / 10)
    assert device.secure_round(nodes, 9, nodes)  # a later honest round: its own charge settles at the k shares
    assert load_ledger(device.context, terms).rounds == {(0.1, 1.0): 1, (0.1, round(math.sqrt(12 / 10), 12)): 1}


def test_a_user_dp_device_sends_nothing_outside_secagg_but_its_registration():
    """A plain training message would return one node's vector with only its share of the noise (1/sqrt(K) of
    sigma C), uncharged: the guard refuses it before the client runs; registration passes."""
    terms = _terms(DevicePolicy(), 0.1, 1.0, 10)
    device = Device(terms)
    for phase in ("train", "popularity", "expand_submit", ""):
        with pytest.raises(PolicyRefusal, match="outside SecAgg"):
            device.mod(_message(None, phase), device.context, device.call_next)
    assert device.reached == []
    device.mod(_message(None, "register"), device.context, device.call_next)
    assert device.reached == ["plain"]


@pytest.mark.parametrize("changed", [{Key.MAX_WEIGHT: 1e12}, {Key.MOD_RANGE: 2**40}, {Key.CLIPPING_RANGE: 1e6},
                                     {Key.TARGET_RANGE: 2**8}])
def test_secagg_setups_that_could_leave_one_vector_alone_in_the_sum_are_refused(changed):
    """A server that gives other nodes another weight (their quantised values round to a constant) or other ranges
    could read one node's vector from the "sum"; the device refuses any setup it would not compute itself."""
    terms = _terms(DevicePolicy(), 0.1, 1.0, 10)
    device = Device(terms)
    with pytest.raises(PolicyRefusal, match="setup"):
        device.mod(_setup(12, 9, terms, **changed), device.context, device.call_next)


def test_a_run_that_asks_for_less_noise_or_a_larger_clip_gets_no_update_from_the_device():
    """A deployed device's policy from its node config: a run config with sigma below its minimum, or C above its
    maximum, never reaches its client (no update is computed or sent), whatever the server's config says."""
    policy = DevicePolicy.from_node_config({"privacy-min-noise-multiplier": 1.0, "privacy-max-clip-norm": 0.5})
    nodes = list(range(1, 11))
    for sigma, clip in ((0.6, 0.5), (1.2, 1.0)):
        device = Device(_terms(policy, 0.1, sigma, floor_nodes(0.8, 10), clip))
        assert not device.secure_round(nodes, 7, nodes)
        assert Stage.COLLECT_MASKED_VECTORS not in device.reached
    device = Device(_terms(policy, 0.1, 1.2, floor_nodes(0.8, 10), 0.5))
    assert device.secure_round(nodes, 7, nodes) and Stage.UNMASK in device.reached
    with pytest.raises(ValueError, match="privacy-min-nodes"):
        DevicePolicy.from_node_config({"privacy-min-nodes": 2})


@pytest.mark.parametrize("attack", ["low threshold", "partial sharing", "unknown node", "both lists", "not active",
                                    "below the floor"])
def test_unmask_requests_no_honest_server_sends_are_refused(attack):
    nodes = list(range(1, 13))
    terms = _terms(DevicePolicy.from_run(SimpleNamespace(target_epsilon=8.0, delta=1e-5, clip_norm=1.0,
                                                         min_node_fraction=0.8), 1.0), 0.1, 1.0, floor_nodes(0.8, 12))
    device = Device(terms)
    threshold, active = 9, nodes
    if attack == "low threshold":
        threshold = 6  # a half-threshold lets a server collect both secrets of a node it calls dropped to half
    elif attack == "partial sharing":
        msg = _setup(12, 9, terms, **{Key.SHARE_NUMBER: 5})
        with pytest.raises(PolicyRefusal, match="every node"):
            device.mod(msg, device.context, device.call_next)
        return
    elif attack == "unknown node":
        active = [*nodes, 99]
    elif attack == "both lists":
        active = nodes  # and a dead list that repeats one of them, below
    elif attack == "not active":
        active = [x for x in nodes if x != OWN]
    elif attack == "below the floor":
        active = nodes[:9]  # threshold met, but 9 shares carry less than sigma C (K = 10)
    if attack == "both lists":
        device.secure_round(nodes, threshold, nodes)  # one honest round first
        device.context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(
            {"nid": OWN, "threshold": threshold, "rd_seed_share_dict:K": nodes, "rd_seed_share_dict:V": [b"s"] * 12})
        msg = _message(Stage.UNMASK, **{Key.ACTIVE_NODE_ID_LIST: nodes, Key.DEAD_NODE_ID_LIST: [3]})
        with pytest.raises(PolicyRefusal, match="both active and dropped"):
            device.mod(msg, device.context, device.call_next)
        return
    if attack == "below the floor" and OWN not in active:
        active = [*active[:-1], OWN]
    assert not device.secure_round(nodes, threshold, active)
    assert Stage.UNMASK not in device.reached  # its shares never released
    # refused at setup: nothing charged; at unmasking: its masked vector had left, so it stays charged in full
    charged = {} if attack == "low threshold" else {(0.1, 1.0): 1}
    assert load_ledger(device.context, terms).rounds == charged


def test_flowers_threshold_at_the_default_fraction_defeats_the_two_list_unmasking_for_every_cohort():
    """At privacy.secagg_threshold = 0.7, Flower's threshold (round(0.7 n), at least 2) passes the device's 2/3 for
    every n, and a server that tells some nodes that node X dropped (to get X's key shares) and others that it is
    alive (to get its mask-seed shares) needs t of each from the n - 1 others, of which c colluding clients give both
    kinds: 2t <= n - 1 + c. It never gets both for any c < n / 3."""
    policy = DevicePolicy()
    for n in range(3, 400):
        t = max(round(0.7 * n), 2)
        policy.admit_threshold(t, n)
        for colluders in range(0, -(-n // 3)):
            assert 2 * t > n - 1 + colluders
    with pytest.raises(PolicyRefusal):
        policy.admit_threshold(max(round(0.5 * 15), 2), 15)


def test_an_upload_the_server_refuses_is_still_charged(tiny_cfg):
    """LDP mode: an upload that reached the server was released, so it counts toward its user's budget even when
    the server's bound check refuses it."""
    from fedrec_flwr.cli.inprocess import run_in_process

    cfg = tiny_cfg("federation.rounds=1", "federation.eval_every=1", "federation.clients_per_round=20")

    def out_of_range(user: int, rnd: int, upload: list[np.ndarray]) -> list[np.ndarray]:  # every even user's
        return [a * 1e3 if a.dtype.kind == "f" and user % 2 == 0 else a for a in upload]

    out = run_in_process(cfg, log_every=0, tamper=out_of_range)
    assert 0 < out["rejected"] < 20 and out["uploads_per_user"]["total"] == 20  # refused or not, all 20 were sent


def test_the_server_charges_the_noise_a_sum_of_k_shares_carries(tiny_cfg):
    """The round core's ledger charges sigma sqrt(k / K) for a sum of k node shares (less than K: more noise would
    be needed, and the devices refuse it)."""
    from fedrec_flwr.fedgnn.bindings import NodeBindings
    from fedrec_flwr.fedgnn.server import FedGNNServer

    cfg = tiny_cfg("privacy.mode=user_dp", "privacy.noise_multiplier=1.0", "federation.clients_per_round=20")
    server = FedGNNServer.from_config(cfg, 80, 3.0)
    rounds = FedGNNRounds.from_config(cfg, server, NodeBindings(60, block_size=10), 4.0)
    assert rounds.mechanism.secure_floor == floor_nodes(0.8, 6) == 5
    assert rounds.mechanism.charged_multiplier(6) == pytest.approx(math.sqrt(6 / 5))


def test_a_deployed_device_takes_part_only_in_runs_of_its_own_privacy_mode(tmp_path, caplog):
    """The server writes the run config: a run that switches a user-DP device to the paper's LDP (or LDP off) gets
    nothing from it, unless its operator opted it into LDP (node config privacy-mode). The server learns only that
    the device refused (Flower hands it the exception's text); the reason stays in the device's log."""
    from fedrec_flwr.flower.client_app import device_guard

    run_config = _paper_run(tmp_path, "privacy.ldp=false")
    seen, call_next = _recorder()
    device = {"data-path": str(tmp_path / "user.npz"), "state-dir": str(tmp_path / "dev")}
    with pytest.raises(PolicyRefusal) as refused:
        device_guard(_message(None, "register"), Context(1, OWN, device, RecordDict(), run_config), call_next)
    assert not seen
    assert "privacy-mode" not in str(refused.value) and "privacy policy" in str(refused.value)
    assert "privacy-mode" in caplog.text
    opted_in = {**device, "privacy-mode": "ldp"}
    paper = {**run_config, "set": ""}  # the paper's LDP (LDP off is refused too: the next test)
    device_guard(_message(None, "register"), Context(1, OWN, opted_in, RecordDict(), paper), call_next)
    assert len(seen) == 1


def test_a_deployed_ldp_device_answers_no_plain_evaluation_unless_its_operator_opts_in(tmp_path, caplog):
    """An LDP device's evaluation reply is its user's exact error sums: a server that sends two evaluation downloads
    differing only in one item's row learns from them whether the user rated that item (shown here on the device's
    own code). So a deployed LDP device refuses every evaluation request by its own policy, whatever the run config
    says, and answers only when its operator opts in (node config privacy-plain-evaluation); the reason stays in
    the device's log. Training messages pass as before."""
    from clients.fedgnn import FedGNNClient
    from fedrec_flwr.config import load_config
    from fedrec_flwr.data import UserData, UserPartitions, prepare_partitions
    from fedrec_flwr.fedgnn.protocol import PHASE_REGISTER, REGISTER_FIELDS, frame_download, split_users
    from fedrec_flwr.fedgnn.server import FedGNNServer
    from fedrec_flwr.fedgnn.user import MemoryStore
    from fedrec_flwr.flower.client_app import device_guard
    from fedrec_flwr.privacy.device_secret import DeviceSecret

    # the attack the policy answers: one item's row nudged, and the exact reply moves iff the user rated the item
    cfg = load_config("fedgnn_paper", "synthetic", [f"data.cache_dir={tmp_path / 'cache'}",
                                                    f"output_dir={tmp_path / 'out'}", "privacy.pseudo_items=20"])
    meta = UserPartitions(prepare_partitions(cfg.data)).meta
    own, test = np.array([2, 5, 9]), np.array([11, 17])
    data = UserData(3, own, np.array([4.0, 2.0, 5.0], np.float32), test, np.array([3.0, 5.0], np.float32))
    client = FedGNNClient(cfg, meta, [3], lambda u: data, MemoryStore(), secret=DeviceSecret(bytes(32)))
    reg, _, _ = client.fit([], {"phase": PHASE_REGISTER, "round": 1})
    (_, fields), = split_users(reg, REGISTER_FIELDS)
    ids = np.sort(fields[0])
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    table = server.table()

    def reply(nudged: int | None) -> float:
        rows = table[ids].copy()
        if nudged is not None:
            rows[np.searchsorted(ids, nudged)] += 0.01
        download = frame_download(server.model_weights(), [3], [rows])
        return client.evaluate(download, {"phase": "train", "round": 2})[2]["sse"]

    base = reply(None)
    rated = {int(i) for i in ids if reply(int(i)) != base}
    assert rated == {2, 5, 9, 11, 17}  # every train and test item of the user, and none of its pseudo items

    # the policy: refused by default on a deployed LDP device, answered with the operator's opt-in
    run_config = _paper_run(tmp_path)
    seen, call_next = _recorder()
    evaluate = Message(metadata=Metadata(1, "e", 0, OWN, "", "", time.time(), 600.0, MessageType.EVALUATE),
                       content=RecordDict())
    device = {"data-path": str(tmp_path / "user.npz"), "state-dir": str(tmp_path / "dev"), "privacy-mode": "ldp"}
    with pytest.raises(PolicyRefusal) as refused:
        device_guard(evaluate, Context(1, OWN, device, RecordDict(), run_config), call_next)
    assert not seen and "privacy policy" in str(refused.value) and "plain evaluation" in caplog.text
    device_guard(_message(None, "register"), Context(1, OWN, device, RecordDict(), run_config), call_next)
    assert len(seen) == 1  # training and registration pass
    opted_in = {**device, "privacy-plain-evaluation": "true"}
    device_guard(evaluate, Context(1, OWN, opted_in, RecordDict(), run_config), call_next)
    assert len(seen) == 2
    with pytest.raises(DevicePolicyError, match="privacy-plain-evaluation"):
        DevicePolicy.from_node_config({**device, "privacy-plain-evaluation": "sometimes"})


def test_evaluations_leave_only_through_secagg_with_their_own_range_and_charge():
    """A plain evaluation request is refused (it would return exact error sums); an evaluation round is charged as a
    release every user is in (q = 1, sigma_e), and must have been set up with the evaluation's SecAgg+ range."""
    terms = DeviceTerms(DevicePolicy(min_noise_multiplier=0.5), 0.1, 1.0, 1.0, 10, 3.5, 2**24,
                        eval_noise_multiplier=4.0, eval_clipping_range=1.0 + 8 * 4.0 / math.sqrt(10))
    device = Device(terms)
    evaluate = Message(metadata=Metadata(1, "e", 0, OWN, "", "", time.time(), 600.0, MessageType.EVALUATE),
                       content=RecordDict())
    with pytest.raises(PolicyRefusal, match="no plain evaluation"):
        device.mod(evaluate, device.context, device.call_next)
    nodes = list(range(1, 13))

    def round_of(phase: str, clipping_range: float) -> bool:
        device.reached.clear()
        device.context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(
            {"nid": OWN, "threshold": 9, "rd_seed_share_dict:K": nodes, "rd_seed_share_dict:V": [b"s"] * 12})
        try:
            for msg in (_setup(12, 9, terms, **{Key.CLIPPING_RANGE: clipping_range}),
                        _message(Stage.SHARE_KEYS, **{str(n): [b"a", b"b"] for n in nodes}),
                        _message(Stage.COLLECT_MASKED_VECTORS, phase, **{Key.CIPHERTEXT_LIST: [b"c"] * 11,
                                                                         Key.SOURCE_LIST: nodes[1:]}),
                        _message(Stage.UNMASK, **{Key.ACTIVE_NODE_ID_LIST: nodes, Key.DEAD_NODE_ID_LIST: []})):
                device.mod(msg, device.context, device.call_next)
        except PolicyRefusal:
            return False
        return True

    assert not round_of("evaluate-sum", terms.clipping_range)  # an evaluation set up with the training range
    assert Stage.COLLECT_MASKED_VECTORS not in device.reached
    assert round_of("evaluate-sum", terms.eval_clipping_range)
    assert load_ledger(device.context, terms).rounds == {(1.0, round(4.0 * math.sqrt(12 / 10), 12)): 1}


def test_a_masked_vector_leaves_at_the_policy_deadline_whether_the_device_trained_or_not():
    """The server times each node's masked-vector reply. A deployed device whose user sampled itself computes for
    seconds, one whose user did not for milliseconds: without the deadline the reply time says who trained, which
    undoes the subsampling the accounting relies on. Behind the guard both leave `reply_seconds` after the
    request (a clock the test drives); a step that overran leaves when it is done, and a simulation holds nothing."""
    assert DevicePolicy.from_node_config({}).reply_seconds == 5.0  # deployed: on by default
    assert DevicePolicy.from_node_config({"privacy-reply-seconds": "20"}).reply_seconds == 20.0
    with pytest.raises(DevicePolicyError, match="reply-seconds"):
        DevicePolicy.from_node_config({"privacy-reply-seconds": "-1"})

    class TimedDevice(Device):
        def __init__(self, terms: DeviceTerms, compute: float):
            super().__init__(terms)
            self.now, self.compute, self.replied_at = 100.0, compute, None
            self.mod = privacy_guard(lambda context: terms, clock=lambda: self.now, sleep=self.sleep)

        def sleep(self, seconds: float) -> None:
            self.now += seconds

        def call_next(self, msg, context):
            configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            if configs is not None and str(configs[Key.STAGE]) == Stage.COLLECT_MASKED_VECTORS:
                self.now += self.compute
            return super().call_next(msg, context)

    def reply_time(policy: DevicePolicy, compute: float) -> float:
        device = TimedDevice(_terms(policy, 0.5, 1.0, 4), compute)
        nodes = [OWN, 2, 3, 4, 5]
        device.context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(
            {"nid": OWN, "threshold": 4, "rd_seed_share_dict:K": nodes, "rd_seed_share_dict:V": [b"s"] * 5})
        device.mod(_setup(5, 4, device.terms), device.context, device.call_next)
        device.mod(_message(Stage.SHARE_KEYS, **{str(n): [b"pk1", b"pk2"] for n in nodes}), device.context,
                   device.call_next)
        start = device.now
        device.mod(_message(Stage.COLLECT_MASKED_VECTORS, **{Key.CIPHERTEXT_LIST: [b"c"] * 4,
                                                             Key.SOURCE_LIST: nodes[1:]}), device.context,
                   device.call_next)
        return device.now - start

    deployed = DevicePolicy(reply_seconds=5.0)
    assert reply_time(deployed, 0.02) == reply_time(deployed, 3.0) == pytest.approx(5.0)
    assert reply_time(deployed, 7.0) == pytest.approx(7.0)  # overran: leaves when done (and logs it)
    simulated = DevicePolicy(reply_seconds=0.0)
    assert reply_time(simulated, 0.02) == pytest.approx(0.02)


def test_a_user_dp_device_refuses_any_message_carrying_a_neighbour_service_link():
    """Graph expansion would send embeddings and item tokens outside SecAgg+, to an address the server picks: the
    guard refuses a secure or plain message whose config carries a neighbour-service key, before the client runs."""
    device = Device(_terms(DevicePolicy(), 0.5, 1.0, 4))
    for stage in (None, Stage.SETUP):
        msg = _message(stage, "train", **({} if stage is None else {Key.SHARE_NUMBER: 5}))
        msg.content.config_records[FIT_CONFIG]["nb_address"] = "server.example:1"
        with pytest.raises(PolicyRefusal, match="neighbour-service link"):
            device.mod(msg, device.context, device.call_next)
    assert device.reached == []


@pytest.mark.parametrize("weaker, why", [
    ("privacy.ldp=false", "turns LDP off"),
    ("privacy.noise_lambda=0.1", "epsilon 2 per coordinate"),
    ("privacy.pseudo_items=10", "10 pseudo items"),
    ("privacy.pseudo_sampler=popularity privacy.popularity_epsilon=8", "popularity reports at epsilon 8"),
    ("privacy.pseudo_sampler=popularity privacy.pseudo_ratio=1", "1 pseudo items per own item"),
])
def test_an_ldp_device_uploads_only_at_the_protection_its_policy_asks(tmp_path, caplog, weaker, why):
    """A device its operator opted into the paper's LDP still holds limits of its own: a run config that turns LDP
    off, raises the per-coordinate epsilon, or thins the pseudo items gets nothing from it (the reason in its log);
    the paper's own settings pass."""
    from fedrec_flwr.flower.client_app import device_guard

    def run_config(extra: str) -> dict:
        return {"preset": "fedgnn_paper", "dataset": "synthetic", "data-dir": str(tmp_path), "seed": 0,
                "cache-dir": str(tmp_path / "cache"), "output-dir": str(tmp_path / "out"), "set": extra}

    seen = []
    device = {"data-path": str(tmp_path / "user.npz"), "state-dir": str(tmp_path / "dev"), "privacy-mode": "ldp"}
    with pytest.raises(PolicyRefusal, match="privacy policy"):
        device_guard(_message(None, "register"), Context(1, OWN, device, RecordDict(), run_config(weaker)),
                     lambda m, c: seen.append(m))
    assert not seen and why in caplog.text
    device_guard(_message(None, "register"), Context(1, OWN, device, RecordDict(), run_config("")),
                 lambda m, c: seen.append(m))
    assert len(seen) == 1
