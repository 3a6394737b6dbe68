"""The batched local step gives each user the numbers of its PyG formulation (tests/oracle_local_step.py), in
any batch: uploads, private states and whole runs."""

import numpy as np
import pytest
import torch
from oracle_local_step import oracle_uploads

from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.local_step import size_groups, train_users
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore
from fedrec_flwr.inprocess import run_in_process
from fedrec_flwr.models.rating_gnn import build_model, row_width

DELTA = ["local.upload=delta", "local.steps=3", "local.batch_size=7", "local.loss=mean", "local.user_steps=3",
         "model.user_offset=true", "data.item_features=true", "model.biases=false", "model.heads=2"]
# item rows of width d + 1 (the last column b_i), private offsets from each user's own mean, with features and biases
ITEM_BIAS = ["model.item_bias=true", "model.user_offset=true", "model.user_offset_init=mean", "data.item_features=true",
             "model.biases=true", "local.user_steps=2", "local.steps=2", "local.batch_size=9"]


# The batched path (dense padded stars) and the PyG oracle (PyG's scatter) sum the same terms in different
# orders, so they agree to float32 rounding, not bitwise: with unit roundoff u = 6e-8 and at most a few hundred
# terms per sum, a gradient entry of magnitude g differs by up to ~1e-5 g; the LDP noise drawn after it is the
# same draw on both paths. Measured on an AMD EPYC: at most 0.18 of these bounds (GAT / GCN / GGNN, 3 configs).
UPLOAD_ATOL, UPLOAD_RTOL = 2e-6, 1e-5


def _uploads(tmp_path, gnn: str, extra: list[str], batch: int | None):
    """24 users' uploads and states after one round, in batches of `batch` (None: through the PyG oracle)."""
    cfg = load_config("quickstart", None, [f"data.cache_dir={tmp_path}", "privacy.pseudo_sampler=uniform",  # no round 0
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
    uploads = oracle_uploads(users, weights, rows, 3) if batch is None else train_users(users, weights, rows, 3, None, batch)
    return uploads, [(st.embedding, st.offset) for st in (store.states[u.user] for u in users)]


@pytest.mark.parametrize("gnn", ["gat", "gcn", "ggnn"])
@pytest.mark.parametrize("extra", [[], DELTA, ITEM_BIAS], ids=["gradient", "delta-offset-features", "item-bias-mean-offset"])
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
        for (ea, oa), (eb, ob) in zip(states_oracle, states_batched):
            np.testing.assert_allclose(ea, eb, atol=1e-6)
            assert oa == pytest.approx(ob, abs=1e-6)


def test_a_run_with_sixteen_users_per_batch_matches_one_at_a_time(tmp_path):
    def run(batch: int):
        cfg = load_config("quickstart", None, [f"data.cache_dir={tmp_path}", "privacy.pseudo_sampler=uniform", "model.dim=8", "federation.rounds=4",
                                               "federation.eval_every=4", "federation.clients_per_round=48",
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
