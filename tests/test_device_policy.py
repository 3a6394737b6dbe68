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

from clients.privacy_guard import DeviceTerms, load_ledger, privacy_guard
from fedrec_flwr.fedgnn.accounting import UserDPAccountant, calibrate_noise_multiplier
from fedrec_flwr.fedgnn.device_policy import DevicePolicy, PolicyRefusal, charged_multiplier, floor_nodes
from fedrec_flwr.fedgnn.rounds import FedGNNRounds

OWN = 5


def _message(stage: str, **configs) -> Message:
    metadata = Metadata(1, stage, 0, OWN, "", "", time.time(), 600.0, MessageType.TRAIN)
    return Message(metadata=metadata, content=RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: stage,
                                                                                          **configs})}))


class Device:
    """One node behind the guard: `call_next` answers every stage and notes which stages reached it."""

    def __init__(self, terms: DeviceTerms):
        self.context = Context(1, OWN, {"partition-id": 0}, RecordDict(), {})
        self.mod = privacy_guard(lambda context: terms)
        self.reached: list[str] = []

    def call_next(self, msg: Message, context: Context) -> Message:
        stage = str(msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
        self.reached.append(stage)
        meta = msg.metadata
        return Message(metadata=Metadata(1, "reply", OWN, 0, meta.message_id, "", time.time(), 600.0,
                                         meta.message_type), content=RecordDict())

    def secure_round(self, nodes: list[int], threshold: int, active: list[int]) -> bool:
        """One SecAgg+ round among `nodes` with the `active` ones left at unmasking; True if the device released its
        shares (the sum could be unmasked), False if it refused at some stage."""
        n = len(nodes)
        self.reached.clear()
        self.context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(
            {"nid": OWN, "threshold": threshold, "rd_seed_share_dict:K": list(nodes),
             "rd_seed_share_dict:V": [b"s"] * n})
        stages = [
            _message(Stage.SETUP, **{Key.SHARE_NUMBER: n, Key.SAMPLE_NUMBER: n, Key.THRESHOLD: threshold}),
            _message(Stage.SHARE_KEYS, **{str(nid): [b"pk1", b"pk2"] for nid in nodes}),
            _message(Stage.COLLECT_MASKED_VECTORS, **{Key.CIPHERTEXT_LIST: [b"c"] * (n - 1),
                                                      Key.SOURCE_LIST: [x for x in nodes if x != OWN]}),
            _message(Stage.UNMASK, **{Key.ACTIVE_NODE_ID_LIST: list(active),
                                      Key.DEAD_NODE_ID_LIST: [x for x in nodes if x not in active]}),
        ]
        try:
            for msg in stages:
                self.mod(msg, self.context, self.call_next)
        except PolicyRefusal:
            return False
        return True


def _terms(policy: DevicePolicy, q: float, sigma: float, floor: int) -> DeviceTerms:
    return DeviceTerms(policy, q, sigma, 1.0, floor)


def test_no_dropout_takes_a_device_past_its_budget_and_its_ledger_agrees_with_the_servers():
    """60 one-user nodes, noise floor K = 48. The server keeps asking for rounds (three times what the budget
    allows) with random dropouts before unmasking. The device never lets a sum with fewer than K nodes through,
    charges each released round at the noise its k shares carry, sits out once one more round would pass its
    target, and its ledger equals the server's (which charges the same k) round for round."""
    nodes, q, target, planned = list(range(1, 61)), 20 / 60, 4.0, 30
    sigma = calibrate_noise_multiplier(q, planned, target, 1e-5)
    privacy = SimpleNamespace(target_epsilon=target, delta=1e-5, clip_norm=1.0, min_node_fraction=0.8)
    policy = DevicePolicy.from_run(privacy, sigma)
    floor = policy.floor_nodes(len(nodes))
    assert floor == 48
    device = Device(_terms(policy, q, sigma, floor))
    server = UserDPAccountant(60, q, sigma, 1.0, 1e-5, target)
    rng = np.random.default_rng(0)
    released = refused_small = 0
    for _ in range(3 * planned):
        k = int(rng.integers(40, 61))  # 0 to 20 nodes drop after sending their masked vectors
        active = [OWN, *rng.choice([x for x in nodes if x != OWN], k - 1, replace=False).tolist()]
        if device.secure_round(nodes, math.ceil(0.7 * 60), active):
            released += 1
            server.record_round(charged_multiplier(sigma, k, floor))
            assert k >= floor
        elif k < floor:
            refused_small += 1
            assert Stage.UNMASK not in device.reached  # its shares never reached the server
        ledger = load_ledger(device.context, _terms(policy, q, sigma, floor))
        assert ledger.epsilon(1e-5) <= target * (1 + 1e-9)
        assert ledger.epsilon(1e-5) == pytest.approx(server.epsilon(), rel=1e-9, abs=1e-12)
    assert refused_small > 0 and planned <= released < 3 * planned  # dropouts add noise: more rounds than planned fit


def test_a_run_that_asks_for_less_noise_or_a_larger_clip_gets_no_update_from_the_device():
    """A deployed device's policy from its node config: a run config with sigma below its minimum, or C above its
    maximum, never reaches its client (no update is computed or sent), whatever the server's config says."""
    policy = DevicePolicy.from_node_config({"privacy-min-noise-multiplier": 1.0, "privacy-max-clip-norm": 0.5})
    nodes = list(range(1, 11))
    for sigma, clip in ((0.6, 0.5), (1.2, 1.0)):
        device = Device(DeviceTerms(policy, 0.1, sigma, clip, floor_nodes(0.8, 10)))
        assert not device.secure_round(nodes, 7, nodes)
        assert Stage.COLLECT_MASKED_VECTORS not in device.reached
    device = Device(DeviceTerms(policy, 0.1, 1.2, 0.5, floor_nodes(0.8, 10)))
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
        msg = _message(Stage.SETUP, **{Key.SHARE_NUMBER: 5, Key.SAMPLE_NUMBER: 12, Key.THRESHOLD: 4})
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
    assert load_ledger(device.context, terms).released == 0


def test_flowers_threshold_at_the_default_fraction_defeats_the_two_list_unmasking_for_every_cohort():
    """At privacy.secagg_threshold = 0.7, Flower's threshold (round(0.7 n), at least 2) passes the device's 2/3 for
    every n, and a server that tells some nodes that node X dropped (to get X's key shares) and others that it is
    alive (to get its mask-seed shares) needs t of each from the n - 1 others: 2t > n - 1, so it never gets both."""
    policy = DevicePolicy()
    for n in range(3, 400):
        t = max(round(0.7 * n), 2)
        policy.admit_threshold(t, n)
        assert 2 * t > n - 1
    with pytest.raises(PolicyRefusal):
        policy.admit_threshold(max(round(0.5 * 15), 2), 15)


def test_an_upload_the_server_refuses_is_still_charged(tiny_cfg):
    """LDP mode: an upload that reached the server was released, so it counts toward its user's budget even when
    the server's bound check refuses it."""
    from fedrec_flwr.inprocess import run_in_process

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
    assert rounds.secure_floor == floor_nodes(0.8, 6) == 5
    assert rounds.charged_multiplier(6) == pytest.approx(math.sqrt(6 / 5))
