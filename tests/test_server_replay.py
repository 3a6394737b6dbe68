"""A curious server replays a device's privacy draws from everything it holds: at chance, in both FedGNN modes.

The strongest replay we know: the server runs the device's own code for the same user, round and weights, with
everything it holds (the run config and its seed, the node config it assigned, the messages) and, to be generous,
even the user's data and state; all it lacks is the device's secret, for which it uses the one the device code
derives from what the server holds. Before device secrets every draw came from (run seed, user, stream), and this
replay gave back the device's noise exactly (its difference from the real upload was 0), its sampling coins and its
pseudo items. Each test here fails on such a mechanism."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from flwr.app import RecordDict
from flwr.common import Context

from clients.user_store import NodeStateStore
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.local_step import train_users
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore
from fedrec_flwr.fedgnn.user_dp import node_update, samples_itself
from fedrec_flwr.flower.client_app import device_secret
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.privacy.device_secret import DeviceSecret, DeviceSecretError


def _secrets(cfg, partition: int) -> tuple[DeviceSecret, DeviceSecret]:
    """(the device's own secret, the server's best replay of it). The device keeps its secret in its node state; the
    server calls the same code with the run config and the node config it holds, without the device's state."""
    node_config = {"partition-id": partition, "num-partitions": 4}
    device_context = Context(1, 7, node_config, RecordDict(), {})
    own = device_secret(cfg, device_context)
    assert device_secret(cfg, device_context) == own  # the device keeps one secret for the run
    server = device_secret(cfg, Context(1, 7, dict(node_config), RecordDict(), {}))
    return own, server


# Rounds whose noise shares a replay test pools: 4 x 1,585 coordinates of the tiny config, so the sample std of two
# independent shares' difference has a relative standard error of 1 / sqrt(2 N) = 0.9%, and SHARE_TOLERANCE is 5.6 of
# them (one round alone left 2.8: an honest run missed it about once in 200). A replay that shares a fraction rho of
# the noise leaves sqrt(1 - rho) of it: rho = 0.1 already fails.
SHARE_ROUNDS = (2, 3, 4, 5)
SHARE_TOLERANCE = 0.05


def _difference(real: list[np.ndarray], guess: list[np.ndarray]) -> np.ndarray:
    """The two replies' difference, flat: where their updates agree, what is left is their noise shares'."""
    return np.concatenate([(a - b).ravel() for a, b in zip(real, guess)])


def _pair(cfg, secrets: tuple[DeviceSecret, DeviceSecret], user: int):
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
    return [FedGNNUser(DeviceSections.from_config(cfg, s), meta, parts.user(user), MemoryStore(), model=model)
            for s in secrets], meta


def test_the_server_cannot_replay_ldp_noise_pseudo_items_or_pseudo_rows(tiny_cfg):
    cfg = tiny_cfg("simulation.device_secrets=''", "model.dropout=0", "privacy.pseudo_items=20")
    secrets = _secrets(cfg, 0)
    assert secrets[0] != secrets[1]
    overlaps, chance, diffs = [], [], []
    for u in range(6):
        (device, replay), meta = _pair(cfg, secrets, u)
        real_set, guess_set = device.register(), replay.register()
        own = np.union1d(device.data.train_items, device.data.test_items)
        pseudo, guessed = np.setdiff1d(real_set, own), np.setdiff1d(guess_set, own)
        overlaps.append(np.intersect1d(pseudo, guessed).size / pseudo.size)
        chance.append(guessed.size / (meta.num_items - own.size))  # a random guess of as many unrated items
        replay.state = device.state.copy()  # the server knows the set it received; give it the state too
        server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
        weights, rows = server.model_weights(), server.table()[device.state.anonymity_ids]
        real = train_users([device], weights, [rows], 3)[0]
        guess = train_users([replay], weights, [rows], 3)[0]
        diffs.append(np.concatenate([(a - b).ravel() for a, b in zip(real, guess) if a.dtype.kind == "f"]))
    # pseudo items: the replay finds them no better than a random draw of as many items
    assert np.mean(overlaps) < np.mean(chance) + 0.15, (overlaps, chance)
    # noise: what the replay leaves of each coordinate is the difference of two independent Laplace(lambda) draws
    # (each of std lambda sqrt 2, their difference 2 lambda = 0.4); a replayed stream would leave exactly 0
    d = np.concatenate(diffs)
    assert np.std(d) == pytest.approx(2 * cfg.privacy.noise_lambda, rel=0.1)
    assert np.mean(np.abs(d) < 1e-6) < 0.01


def test_the_server_cannot_replay_user_dp_coins_or_noise_shares(tiny_cfg):
    cfg = tiny_cfg("simulation.device_secrets=''", "privacy.mode=user_dp", "privacy.noise_multiplier=1",
                   "model.dropout=0")
    secrets = _secrets(cfg, 1)
    # coins at q = 1/2 over 60 users x 10 rounds: the replay agrees with half of them, as a fair guess does
    agree = np.mean([samples_itself(secrets[0], u, r, 0.5) == samples_itself(secrets[1], u, r, 0.5)
                     for u in range(60) for r in range(2, 12)])
    assert abs(agree - 0.5) < 0.08, agree
    (device, replay), meta = _pair(cfg, secrets, 4)
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    std = 0.3
    d = np.concatenate([_difference(node_update([device], server.model_weights(), server.table(), r, None, 8, 1.0, std),
                                    node_update([replay], server.model_weights(), server.table(), r, None, 8, 1.0, std))
                        for r in SHARE_ROUNDS])
    # the same clipped update in both: what is left is two independent shares, std 0.3 sqrt 2
    assert np.std(d) == pytest.approx(std * np.sqrt(2), rel=SHARE_TOLERANCE)


def test_a_devices_secret_is_its_own_kept_and_never_taken_from_the_run_config(tiny_cfg, tmp_path):
    """A deployed device draws its secret once (mode 600) and keeps it; a run config that names a secrets file
    (which the server writes) is ignored by a deployed node; a bad secret file is refused in one line."""
    cfg = tiny_cfg(f"simulation.device_secrets={tmp_path / 'experimenter'}")
    state_dir = tmp_path / "device"
    deployed = {"user-id": 3, "state-dir": str(state_dir)}
    first = device_secret(cfg, Context(1, 9, deployed, RecordDict(), {}))
    assert (state_dir / "device-secret").stat().st_mode & 0o777 == 0o600
    assert device_secret(cfg, Context(1, 9, dict(deployed), RecordDict(), {})) == first  # kept across restarts
    simulated = device_secret(cfg, Context(1, 9, {"partition-id": 0}, RecordDict(), {}))
    assert simulated == DeviceSecret.load_or_create(tmp_path / "experimenter") != first
    no_dir = device_secret(cfg, Context(1, 9, {"user-id": 3}, RecordDict(), {}))
    assert no_dir not in (simulated, first)  # deployed without a state dir: its own, not the run config's file
    assert "<hidden>" in repr(first) and first.fingerprint() != simulated.fingerprint()
    bad = tmp_path / "bad"
    bad.write_text("abc\n")
    bad.chmod(0o600)
    with pytest.raises(DeviceSecretError, match="hex characters"):
        DeviceSecret.load_or_create(bad)
    bad.write_text("00" * 32)
    bad.chmod(0o644)
    with pytest.raises(DeviceSecretError, match="read by other users"):
        DeviceSecret.load_or_create(bad)


def test_fixed_device_secrets_replay_a_run_and_leave_no_trace_in_what_the_server_holds(tiny_cfg, tmp_path):
    """The experimenter's file replays an in-process run bit for bit; another file (or none) gives other draws. The
    secret appears nowhere in the run's output folder (results.json, rounds.csv, checkpoints)."""
    from fedrec_flwr.cli.inprocess import run_in_process

    common = ("federation.rounds=2", "federation.eval_every=2", "federation.clients_per_round=20",
              "checkpoint.every=1")
    first = run_in_process(tiny_cfg(*common, f"output_dir={tmp_path / 'a'}"), log_every=0)
    again = run_in_process(tiny_cfg(*common, f"output_dir={tmp_path / 'b'}"), log_every=0)
    other = run_in_process(tiny_cfg(*common, f"simulation.device_secrets={tmp_path / 'other'}",
                                    f"output_dir={tmp_path / 'c'}"), log_every=0)
    assert first["rmse"] == again["rmse"] != other["rmse"]
    secret_hex = (tmp_path / "device-secrets").read_text().strip()
    for folder in ("a", "b", "c"):
        for path in (tmp_path / folder).rglob("*"):
            if path.is_file():
                assert secret_hex.encode() not in path.read_bytes()
                assert bytes.fromhex(secret_hex) not in path.read_bytes()


def test_a_round_the_server_sends_again_gets_fresh_draws(tiny_cfg):
    """The streams of a round are keyed by the round and by how often the device was asked for it: a server that
    repeats round r with another model (or a new run that reuses r on a device that keeps its secret) gets new
    noise, so the difference of the two replies is not noise-free; coins are fresh too."""
    cfg = tiny_cfg("privacy.mode=user_dp", "privacy.noise_multiplier=1", "model.dropout=0")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    store = MemoryStore()
    device_cfg = DeviceSections.from_config(cfg)
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)

    def reply():
        user = FedGNNUser(device_cfg, meta, parts.user(4), store, model=model)  # a new message, the same device
        return node_update([user], server.model_weights(), server.table(), 7, None, 8, 1.0, 0.3)

    pairs = [(reply(), reply()) for _ in SHARE_ROUNDS]  # round 7 again and again: every reply gets fresh draws
    d = np.concatenate([_difference(first, again) for first, again in pairs])
    assert np.std(d) == pytest.approx(0.3 * np.sqrt(2), rel=SHARE_TOLERANCE)
    assert store.draws[(4, 7)] == 2 * len(SHARE_ROUNDS)


def test_two_runs_the_server_interleaves_on_one_device_never_share_a_draw(tiny_cfg, tmp_path):
    """A deployed device keeps one secret and one draw count (`draws.json` in its state dir) across runs. A server that
    runs A and B on it, alternating their rounds, asks both for round 2: were the attempt counted per run, both would
    get the same coin and noise share, and A's sum minus B's would be noise-free. The count is the file's, under a
    lock, at every draw: B's round 2 is attempt 1, and the difference carries two independent shares."""
    cfg = tiny_cfg("privacy.mode=user_dp", "privacy.noise_multiplier=1", "model.dropout=0")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    secret = DeviceSecret.load_or_create(tmp_path / "state" / "device-secret")
    draws = tmp_path / "state" / "draws.json"
    run_a, run_b = NodeStateStore(RecordDict(), None, draws), NodeStateStore(RecordDict(), None, draws)
    device_cfg = DeviceSections.from_config(cfg, secret)
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)

    def reply(store, server_round):
        user = FedGNNUser(device_cfg, meta, parts.user(4), store, model=model)
        return user.round_key(server_round), node_update([user], server.model_weights(), server.table(),
                                                         server_round, None, 8, 1.0, 0.3)

    differences = []
    for r in SHARE_ROUNDS:
        (key_a, vec_a), (key_b, vec_b) = reply(run_a, r), reply(run_b, r)
        assert key_a == (r, 0) and key_b == (r, 1)
        differences.append(_difference(vec_a, vec_b))
    # the same model: only the two noise shares differ
    assert np.std(np.concatenate(differences)) == pytest.approx(0.3 * np.sqrt(2), rel=SHARE_TOLERANCE)


@pytest.mark.parametrize("mode", ["ldp", "user_dp"])
def test_the_server_cannot_point_a_device_at_a_neighbour_service_of_its_own(tiny_cfg, mode):
    """The round config carries the neighbour-service link (address, token key, run secret). A server that swaps in
    its own address would receive the users' embeddings and item tokens, hashed under the key it also sent: their
    items. A deployed LDP device contacts only the service its node config names; a user-DP device does no graph
    expansion at all (and its guard refuses any message that carries a link, tests/test_device_policy.py)."""
    from clients.fedgnn import FedGNNClient
    from fedrec_flwr.fedgnn.protocol import PHASE_EXPAND_SUBMIT, PHASE_TRAIN, ExpansionLink, RoundConfig
    from tests.conftest import TEST_SECRET

    cfg = tiny_cfg(f"privacy.mode={mode}")
    parts = UserPartitions(prepare_partitions(cfg.data))
    client = FedGNNClient(cfg, parts.meta, [0], parts.user, NodeStateStore(RecordDict()), secret=TEST_SECRET,
                          neighbour_service="service.example:8765", neighbour_ca="ca.crt")
    evil = ExpansionLink(b"k" * 32, "server.example:1", "run", "secret")
    for rc in (RoundConfig(PHASE_EXPAND_SUBMIT, 2, expansion=evil),
               RoundConfig(PHASE_TRAIN, 3, expansion=evil, refresh_neighbours=True)):
        why = "does no graph expansion" if mode == "user_dp" else "than the one its node config names"
        with pytest.raises(ValueError, match=why):
            client.fit([], rc.to_flower())
    if mode == "ldp":  # the service the device's own config names is used, over TLS with its own CA file only
        own = ExpansionLink(b"k" * 32, "service.example:8765", "run", "secret")
        client._check_link(RoundConfig(PHASE_EXPAND_SUBMIT, 2, expansion=own))
        assert client.device_cfg.ca_file == "ca.crt"  # not the run config's expansion.ca_file
        no_ca = FedGNNClient(cfg, parts.meta, [0], parts.user, NodeStateStore(RecordDict()), secret=TEST_SECRET,
                             neighbour_service="service.example:8765")
        with pytest.raises(ValueError, match="only over TLS"):
            no_ca._check_link(RoundConfig(PHASE_EXPAND_SUBMIT, 2, expansion=own))


def test_registering_a_device_again_gives_the_server_the_same_anonymity_set(tiny_cfg):
    """LDP mode: real items are in every anonymity set a user registers, pseudo items vary with the draw. A server that
    registers one device in several runs (publishing another popularity, or another pseudo-item count, each time)
    and intersects the sets would keep mostly real items. The device commits to its first set: later runs get it
    again; a user with a new rating outside it gets it joined with a fresh draw, which still contains it."""
    cfg = tiny_cfg("privacy.pseudo_items=30")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    store = MemoryStore()  # the device's store across runs (its disk in a deployment)
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)

    def register(run_cfg, data) -> np.ndarray:
        store.states.clear()  # a new run: no user state, the same device
        return FedGNNUser(DeviceSections.from_config(run_cfg), meta, data, store,
                          model=model).register().astype(np.int64)

    first = register(cfg, parts.user(4))
    assert register(tiny_cfg("privacy.pseudo_items=10"), parts.user(4)).tolist() == first.tolist()
    assert register(tiny_cfg("privacy.pseudo_items=60", "seed=5"), parts.user(4)).tolist() == first.tolist()
    store.states.clear()  # a run whose first message to the device is a training round, not a registration
    trained_first = FedGNNUser(DeviceSections.from_config(tiny_cfg("privacy.pseudo_items=12")), meta, parts.user(4),
                               store, model=model)
    assert trained_first.state.anonymity_ids.tolist() == first.tolist()
    data = parts.user(4)
    new_item = int(np.setdiff1d(np.arange(meta.num_items), first)[0])
    data.test_items = np.append(data.test_items, new_item)  # a rating the committed set does not hold
    grown = register(cfg, data)
    assert set(first) < set(grown) and new_item in grown


def test_a_simulated_nodes_draw_counts_survive_the_hand_over_of_its_state():
    """A simulated node without a disk counts its draws in its node state, which Flower pickles to the ClientApp
    process with every message and back, and updates them there in place; a round the server sends again after the
    hand-over must still be a new attempt, never the first one's draws."""
    state = RecordDict()
    assert NodeStateStore(state).draw_attempt(3, 5) == 0
    state = pickle.loads(pickle.dumps(state))  # the next message's context, as the simulation hands it over
    store = NodeStateStore(state)
    assert store.draw_attempt(3, 5) == 1
    assert store.draw_attempt(3, 6) == 0
    assert NodeStateStore(pickle.loads(pickle.dumps(state))).draw_attempt(3, 5) == 2
