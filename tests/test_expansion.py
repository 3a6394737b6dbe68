"""Graph expansion inside FedGNN: round schedule, clients expanding through the real service, failures."""

from __future__ import annotations

import numpy as np
import pytest

from clients.fedgnn import FedGNNClient
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import ConfigError
from fedrec_flwr.data import UserData, UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.lifecycle import round_schedule
from fedrec_flwr.fedgnn.local_step import local_gradients
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EXPAND_FETCH,
    PHASE_EXPAND_SUBMIT,
    PHASE_REGISTER,
    PHASE_TRAIN,
)
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.neighbours import NeighbourClient, new_run_key, serve
from strategies.fedgnn import ExpansionLink, FedGNNStrategy
from tests.conftest import TEST_SECRET


def test_schedule_puts_expansion_after_t_epochs(tiny_cfg):
    cfg = tiny_cfg("expansion.mode=fixed", "expansion.epoch=2", "federation.clients_per_round=25",
                   "federation.rounds=10")
    phases = round_schedule(cfg.federation, cfg.expansion, num_users=60)  # 3 rounds per epoch -> after training round 6
    assert phases[0] == PHASE_REGISTER and phases[7:9] == [PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH]
    assert phases.count(PHASE_TRAIN) == 10
    plain = tiny_cfg("federation.rounds=10")
    assert PHASE_EXPAND_SUBMIT not in round_schedule(plain.federation, plain.expansion, 60)
    late = tiny_cfg("expansion.mode=fixed", "expansion.epoch=5", "federation.clients_per_round=25",
                    "federation.rounds=10")
    with pytest.raises(ValueError, match="expansion.epoch = 5 .* federation.rounds = 10"):
        round_schedule(late.federation, late.expansion, 60)


def test_fixed_neighbours_can_be_refreshed_every_k_training_rounds(tiny_cfg):
    cfg = tiny_cfg("expansion.mode=fixed", "expansion.epoch=0", "expansion.refresh_every=4", "federation.rounds=10")
    phases = round_schedule(cfg.federation, cfg.expansion, num_users=60)
    submits = [i for i, p in enumerate(phases) if p == PHASE_EXPAND_SUBMIT]
    trained_before = [phases[:i].count(PHASE_TRAIN) for i in submits]
    assert trained_before == [0, 4, 8] and phases.count(PHASE_TRAIN) == 10
    assert all(phases[i + 1] == PHASE_EXPAND_FETCH for i in submits)
    with pytest.raises(ConfigError, match="refresh_every"):
        tiny_cfg("expansion.mode=trainable", "expansion.refresh_every=4")


def test_an_in_process_run_expands_and_trains_on_its_neighbours(tiny_cfg):
    """The in-process runner follows the same schedule as flwr run: registration, expansion through a service
    process, training; a probe can score the same model with the neighbours left out."""
    cfg = tiny_cfg("expansion.mode=fixed", "expansion.epoch=0", "expansion.refresh_every=2", "federation.rounds=4",
                   "federation.clients_per_round=20", "federation.eval_every=4", "expansion.max_neighbours=4")
    seen = []

    def probe(server, rmse, device_user):
        seen.append(rmse(neighbours=False))
        return {"rmse_without_neighbours": seen[-1]}

    out = run_in_process(cfg, log_every=0, probe=probe)
    phases = [h.get("phase", PHASE_TRAIN) for h in out["history"]]
    assert phases == [PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH, PHASE_TRAIN, PHASE_TRAIN,
                      PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH, PHASE_TRAIN, PHASE_TRAIN]
    fetches = [h for h in out["history"] if h.get("phase") == PHASE_EXPAND_FETCH]
    assert all(0 < h["mean_neighbours"] <= 4 for h in fetches)
    final = out["history"][-1]
    assert np.isfinite(final["rmse"]) and final["rmse"] != final["rmse_without_neighbours"]
    assert out["eval_ratings"] == out["test_ratings"]


def test_trainable_neighbours_refresh_before_each_training_round_in_process(tiny_cfg):
    cfg = tiny_cfg("expansion.mode=trainable", "expansion.epoch=0", "federation.rounds=2",
                   "federation.clients_per_round=20", "expansion.match=random", "expansion.max_neighbours=2")
    out = run_in_process(cfg, log_every=0)
    assert [h.get("phase") for h in out["history"]][:2] == [PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH]
    assert out["history"][1]["mean_neighbours"] == 2  # random matching: N of the others, shared items or not
    assert np.isfinite(out["rmse"])


@pytest.fixture
def service():
    httpd, _ = serve("127.0.0.1", 0)
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _expand_all(cfg, parts, store, config):
    """Two nodes hosting half the users each, as a multiplexed simulation would."""
    users = list(range(parts.meta.num_users))
    half = len(users) // 2
    nodes = [FedGNNClient(cfg, parts.meta, users[:half], parts.user, store, secret=TEST_SECRET),
             FedGNNClient(cfg, parts.meta, users[half:], parts.user, store, secret=TEST_SECRET)]
    for phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
        for node in nodes:
            arrays, n, metrics = node.fit([], {**config, "phase": phase, "round": 2})
            assert arrays == [] and n == len(node.user_ids)  # nothing goes to the recommendation server
            assert set(metrics) <= {"phase", "neighbours", "users"}


def test_clients_get_exactly_their_co_raters_as_anonymous_neighbours(tiny_cfg, service):
    cfg = tiny_cfg("expansion.mode=fixed", "expansion.max_neighbours=1000")
    parts = UserPartitions(prepare_partitions(cfg.data))
    key, run = new_run_key(), "t1"
    NeighbourClient(service).open_run(run, cfg.model.dim, parts.meta.num_items, 1000)
    store = MemoryStore()
    _expand_all(cfg, parts, store, {"nb_key": key, "nb_address": service, "nb_run": run, "nb_retries": 0})
    users = range(parts.meta.num_users)
    embs = {u: store.load(u).embedding for u in users}
    matched = 0
    for u in users:
        got = {tuple(np.round(r, 5)) for r in store.load(u).neighbours}
        mine = parts.user(u).train_items
        expected = {tuple(np.round(embs[v], 5)) for v in users if v != u
                    and np.intersect1d(mine, parts.user(v).train_items).size}
        assert got == expected and tuple(np.round(embs[u], 5)) not in got
        matched += len(expected)
    assert matched > 0  # co-raters exist, so "no neighbours for anyone" would not pass


def test_a_user_without_ratings_expands_to_no_neighbours_and_does_not_stop_the_run(tiny_cfg, service):
    """Real splits have such users (Douban's has one); expansion must not fail on them."""
    cfg = tiny_cfg("expansion.mode=fixed")
    parts = UserPartitions(prepare_partitions(cfg.data))
    empty = UserData(3, np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32))
    data = lambda u: empty if u == 3 else parts.user(u)  # noqa: E731
    key, run = new_run_key(), "t-empty"
    NeighbourClient(service).open_run(run, cfg.model.dim, parts.meta.num_items, 10)
    store = MemoryStore()
    node = FedGNNClient(cfg, parts.meta, [2, 3, 4], data, store, secret=TEST_SECRET)
    node.fit([], {"phase": PHASE_REGISTER, "round": 1})
    config = {"nb_key": key, "nb_address": service, "nb_run": run, "nb_retries": 0, "round": 2}
    for phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
        node.fit([], {**config, "phase": phase})
    assert store.load(3).neighbours.shape == (0, cfg.model.dim)
    assert store.load(2).neighbours.shape[0] >= 1  # users 2 and 4 still found each other (shared items)


def test_neighbours_enter_the_star_graph_and_change_predictions(tiny_cfg):
    cfg = tiny_cfg("model.dropout=0")
    parts = UserPartitions(prepare_partitions(cfg.data))
    data = parts.user(3)
    store = MemoryStore()
    client = FedGNNUser(DeviceSections.from_config(cfg), parts.meta, data, store)
    model = build_model(cfg.model, parts.meta.scale.midpoint)
    rows = np.random.default_rng(0).standard_normal((client.state.anonymity_ids.size,
                                                     cfg.model.dim)).astype(np.float32) * 0.1
    without = local_gradients(client.cfg, model, client.state, data, rows, np.random.default_rng(1))
    client.state.neighbours = np.ones((4, cfg.model.dim), np.float32)
    with_n = local_gradients(client.cfg, model, client.state, data, rows, np.random.default_rng(1))
    assert not np.allclose(without[1], with_n[1])


def test_strategy_stops_instead_of_training_on_half_expanded_graphs(tiny_cfg):
    cfg = tiny_cfg("expansion.mode=fixed", "expansion.epoch=0")
    link = ExpansionLink(new_run_key(), "127.0.0.1:9", "r")
    strategy = FedGNNStrategy(cfg, 80, 3.0, None, 60, link, rating_span=4.0)
    assert strategy.phase(2) == PHASE_EXPAND_SUBMIT
    with pytest.raises(RuntimeError, match="graph expansion \\(expand-submit\\) failed for 1 of 1 nodes"):
        strategy.aggregate_fit(2, [], [ConnectionError("neighbour service unreachable")])


def test_expansion_without_a_service_link_is_refused(tiny_cfg):
    with pytest.raises(ValueError, match="needs a neighbour service link"):
        FedGNNStrategy(tiny_cfg("expansion.mode=fixed", "expansion.epoch=0"), 80, 3.0, None, 60, None, rating_span=4.0)
