"""The batched local step gives each user the numbers of its PyG formulation (tests/oracle_local_step.py), in
any batch: uploads, private states and whole runs."""

import dataclasses

import numpy as np
import pytest
import torch
from oracle_local_step import oracle_uploads, pyg_evaluate

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.local_step import size_groups, train_users
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore, evaluate_user, set_weights
from fedrec_flwr.models.rating_gnn import build_model, row_width
from tests.conftest import fixed_secrets

DELTA = ["local.upload=delta", "local.steps=3", "local.batch_size=7", "local.loss=mean", "local.user_steps=3",
         "model.user_offset=true", "data.item_features=true", "model.biases=false", "model.heads=2",
         "model.population_bias=true", "model.user_offset_reg=2"]  # b_pop's clamped step with delta uploads
# item rows of width d + 1 (the last column b_i), private offsets from each user's own mean, with features and biases
ITEM_BIAS = ["model.item_bias=true", "model.user_offset=true", "model.user_offset_init=mean", "data.item_features=true",
             "model.biases=true", "local.user_steps=2", "local.steps=2", "local.batch_size=9",
             "model.user_offset_reg=5",  # and the offset shrunk as the bias model shrinks a user's bias,
             "model.population_bias=true", "model.personal_shrink=3"]  # b_pop, and the own part weighted n / (n + k)


# The batched path (dense padded stars) and the PyG oracle (PyG's scatter) sum the same terms in different
# orders, so they agree to float32 rounding, not bitwise: with unit roundoff u = 6e-8 and at most a few hundred
# terms per sum, a gradient entry of magnitude g differs by up to ~1e-5 g; the LDP noise drawn after it is the
# same draw on both paths. Measured on an AMD EPYC: at most 0.18 of these bounds (GAT / GCN / GGNN, 3 configs).
UPLOAD_ATOL, UPLOAD_RTOL = 2e-6, 1e-5


def _users(tmp_path, gnn: str, extra: list[str]):
    """24 users of the quickstart data sharing one model (some with neighbours), the model's weights, and item rows
    for each user's anonymity set."""
    cfg = load_config("quickstart", None, [f"data.cache_dir={tmp_path}", "privacy.pseudo_sampler=uniform",  # no round 0
                                           f"simulation.device_secrets={fixed_secrets(tmp_path)}",
                                           f"model.gnn={gnn}", "model.dim=8", *extra])
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    torch.manual_seed(0)
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
    weights = [p.detach().numpy().copy() for p in model.parameters()]
    store = MemoryStore()
    users = [FedGNNUser(DeviceSections.from_config(cfg), meta, parts.user(u), store, None, model) for u in range(24)]
    for u in users:  # some users with neighbours (0-2 of them), as graph expansion leaves them
        u.state.neighbours = np.random.default_rng(u.user).standard_normal((u.user % 3, 8)).astype(np.float32) * 0.1
    rows = [np.random.default_rng(100 + u.user).standard_normal((u.state.anonymity_ids.size, row_width(cfg.model)))
            .astype(np.float32) * 0.1 for u in users]
    return users, weights, rows, store


def _uploads(tmp_path, gnn: str, extra: list[str], batch: int | None):
    """24 users' uploads and states after one round, in batches of `batch` (None: through the PyG oracle)."""
    users, weights, rows, store = _users(tmp_path, gnn, extra)
    uploads = oracle_uploads(users, weights, rows, 3) if batch is None else train_users(users, weights, rows, 3,
                                                                                        None, batch)
    return uploads, [(st.embedding, st.offset) for st in (store.states[u.user] for u in users)]


@pytest.mark.parametrize("gnn", ["gat", "gcn", "ggnn"])
@pytest.mark.parametrize("extra", [[], DELTA, ITEM_BIAS],
                         ids=["gradient", "delta-offset-features", "item-bias-mean-offset"])
def test_evaluation_scores_what_the_pyg_forward_predicts(tmp_path, gnn, extra):
    """A device scores its test ratings through the dense star (no PyG import on the device); PyG's message passing
    on the same star graph gives the same error sums, with neighbours, item biases and features, and for a user
    whose ratings are all test ratings (cold: its star is its own node and its query items, or, without neighbours
    and with b_pop, the population part alone)."""
    users, weights, rows, _ = _users(tmp_path, gnn, extra)
    low, high = users[0].meta.scale.low, users[0].meta.scale.high
    model = users[0].model
    set_weights(model, [w + np.random.default_rng(i).standard_normal(w.shape).astype(np.float32) * 0.1
                        for i, w in enumerate(weights)])  # away from the initial zeros (biases, feature map)
    def cold(u):
        return dataclasses.replace(u.data, train_items=u.data.train_items[:0], train_values=u.data.train_values[:0])
    # cold with one neighbour (user 1), and cold and alone (user 0: the population part alone with b_pop)
    cases = [(u.state, u.data, r) for u, r in zip(users, rows)] + [(users[k].state, cold(users[k]), rows[k])
                                                                    for k in (0, 1)]
    scored = 0
    for state, data, r in cases:
        k = users[0].cfg.model.personal_shrink
        got = evaluate_user(model, state, data, r, low, high, personal_shrink=k)
        want = pyg_evaluate(model, state, data, r, low, high, personal_shrink=k)
        assert got.n == want.n == data.test_items.size
        np.testing.assert_allclose([got.sse, got.sae], [want.sse, want.sae], rtol=1e-5, atol=1e-5)
        scored += got.n
    assert scored > 0


@pytest.mark.parametrize("gnn", ["gat", "gcn", "ggnn"])
@pytest.mark.parametrize("extra", [[], DELTA, ITEM_BIAS],
                         ids=["gradient", "delta-offset-features", "item-bias-mean-offset"])
def test_batched_users_upload_what_the_pyg_oracle_gives_each_alone(tmp_path, gnn, extra):
    oracle, states_oracle = _uploads(tmp_path, gnn, extra, None)
    for batch in (1, 16):
        batched, states_batched = _uploads(tmp_path, gnn, extra, batch)
        assert len(oracle) == len(batched) == 24
        for a, b in zip(oracle, batched):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert x.shape == y.shape and x.dtype == y.dtype
                np.testing.assert_allclose(x, y, atol=UPLOAD_ATOL, rtol=UPLOAD_RTOL)
        assert len(states_oracle) == len(states_batched) == 24
        for (ea, oa), (eb, ob) in zip(states_oracle, states_batched):
            np.testing.assert_allclose(ea, eb, atol=1e-6)
            assert oa == pytest.approx(ob, abs=1e-6)


def test_a_run_with_sixteen_users_per_batch_matches_one_at_a_time(tmp_path):
    def run(batch: int):
        cfg = load_config("quickstart", None, [f"data.cache_dir={tmp_path}", "privacy.pseudo_sampler=uniform",
                                               "model.dim=8", "federation.rounds=4", "federation.eval_every=4",
                                               "federation.clients_per_round=48",
                                               f"simulation.device_secrets={fixed_secrets(tmp_path)}",
                                               f"simulation.user_batch={batch}"])
        return run_in_process(cfg, log_every=0)["rmse"]

    one, sixteen = run(1), run(16)
    assert np.isfinite(one)
    # four rounds of uploads that differ by float32 rounding (above), merged and applied by the same server:
    # the RMSE over ~1,000 ratings moves far less than 1e-5
    assert sixteen == pytest.approx(one, abs=1e-5)


def test_groups_keep_padding_small_on_power_law_degrees():
    sizes = [5, 5, 6, 6, 7, 50, 60, 400, 4000]  # sorted already; one heavy user would pad a fixed group 100-fold
    assert size_groups(list(range(len(sizes))), sizes, batch=32) == [list(range(8)), [8]]  # 8 x 400 slots: small
    groups = size_groups(list(range(len(sizes))), sizes, batch=32, small=0)
    assert sorted(k for g in groups for k in g) == list(range(len(sizes)))
    for g in groups:
        assert len(g) * max(sizes[k] for k in g) <= 1.25 * sum(sizes[k] for k in g)
    assert groups[0] == [0, 1, 2, 3, 4] and groups[-1] == [8]
    assert [len(g) for g in size_groups(list(range(40)), [10] * 40, batch=16)] == [16, 16, 8]  # equal sizes: by batch
