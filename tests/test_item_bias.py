"""model.item_bias (a scalar b_i carried as the last column of an item's row) and model.user_offset_init
(the private offset starting from the user's own mean): rows, predictions, accounting and identity when off."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import ConfigError, load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.bindings import NodeBindings
from fedrec_flwr.fedgnn.local_step import local_gradients, train_users
from fedrec_flwr.fedgnn.rounds import FedGNNRounds
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore, evaluate_user
from fedrec_flwr.messages import UploadRejected
from fedrec_flwr.models.rating_gnn import build_model, row_width
from fedrec_flwr.models.star_graph import build_star_batch
from tests.conftest import fixed_secrets

BIAS = ("model.item_bias=true", "model.dropout=0", "privacy.ldp=false", "local.loss=mean", "local.steps=1",
        "local.batch_size=1000", "local.upload=gradient")


def _user(cfg):
    """The first user with >= 3 training and >= 1 test ratings, on a fresh device, and the partition facts."""
    parts = UserPartitions(prepare_partitions(cfg.data))
    user = next(u for u in range(parts.meta.num_users)
                if parts.user(u).train_items.size >= 3 and parts.user(u).test_items.size)
    torch.manual_seed(0)
    return FedGNNUser(DeviceSections.from_config(cfg), parts.meta, parts.user(user), MemoryStore()), parts.meta


def test_rows_have_width_d_plus_one_and_their_last_column_is_a_bias(tiny_cfg):
    cfg = tiny_cfg(*BIAS)
    d = cfg.model.dim
    assert row_width(cfg.model) == d + 1 and row_width(tiny_cfg().model) == d
    user, meta = _user(cfg)
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    assert tuple(server.items.shape) == (meta.num_items, d + 1)
    assert torch.count_nonzero(server.items[:, d]) == 0 and torch.count_nonzero(server.items[:, :d]) > 0
    server.register(user.user, user.register())
    rows = server.rows_for(user.user)
    assert rows.shape == (user.state.anonymity_ids.size, d + 1)

    # the model: a row whose bias is +1 predicts exactly +1 higher (before any clipping)
    model = build_model(cfg.model, meta.scale.midpoint).eval()
    batch = build_star_batch([4], [3])
    gen = torch.Generator().manual_seed(0)
    user_x, train_x = torch.randn(1, d, generator=gen) * 0.1, torch.randn(4, d + 1, generator=gen) * 0.1
    query_x = torch.randn(3, d + 1, generator=gen) * 0.1
    with torch.no_grad():
        _, before = model(batch, user_x, train_x, query_x)
        query_x[:, d] += 1.0
        _, after = model(batch, user_x, train_x, query_x)
    np.testing.assert_allclose((after - before).numpy(), 1.0, atol=1e-6)
    with pytest.raises(ValueError, match="width"):
        model(batch, user_x, train_x[:, :d], query_x)

    # the device: the bias column's gradient is d loss / d prediction, and goes up with the row
    data = user.data
    step = local_gradients(user.cfg, model, user.state, data, rows, np.random.default_rng(1))
    pos = np.searchsorted(user.state.anonymity_ids, data.train_items)
    with torch.no_grad():
        pred, _ = model.train()(build_star_batch([data.train_items.size]), torch.from_numpy(user.state.embedding[None]),
                                torch.from_numpy(rows[pos]))
    expected = 2.0 * (pred.numpy() + user.state.offset - data.train_values) / data.train_items.size
    assert data.train_items.size <= cfg.local.batch_size  # the whole user in one mini-batch
    np.testing.assert_allclose(step.real_rows[:, d], expected, rtol=1e-4, atol=1e-6)
    upload = train_users([user], server.model_weights(), [rows], 2)[0]
    assert upload[-1].shape == (user.state.anonymity_ids.size, d + 1)
    update = server.validate(user.user, upload)  # accepted at width d + 1, and the merge moves the bias column
    server.apply([update])
    assert torch.count_nonzero(server.items[:, d]) > 0
    with pytest.raises(UploadRejected, match="shape"):
        server.validate(user.user, [*upload[:-1], upload[-1][:, :d]])
    with pytest.raises(ValueError, match="shape"):
        user.item_rows(rows[:, :d])
    # evaluation reads the same rows
    assert evaluate_user(model, user.state, data, rows, meta.scale.low, meta.scale.high).n == data.test_items.size > 0


def test_the_accounting_counts_the_bias_coordinate_of_every_row(tiny_cfg):
    def budget(*extra):
        cfg = tiny_cfg(*extra)
        parts = UserPartitions(prepare_partitions(cfg.data))
        server = FedGNNServer.from_config(cfg, parts.meta.num_items, parts.meta.scale.midpoint)
        rounds = FedGNNRounds.from_config(cfg, server, NodeBindings(parts.meta.num_users, block_size=1), 4.0)
        ids = np.arange(47)  # one user with an anonymity set of 47 items, one upload
        server.register(0, ids)
        rounds.mechanism.record_upload(0)
        model = sum(int(np.prod(s)) for s in server.model_shapes)
        return rounds.privacy_budget()["per_upload"]["coordinates"], model, cfg.model.dim

    plain, model, d = budget()
    biased, model_b, _ = budget("model.item_bias=true")
    assert model_b == model and plain == model + 47 * d
    assert biased == plain + 47  # one more coordinate per row of the set


def test_user_offset_init_mean_starts_each_user_at_its_own_mean(tiny_cfg):
    cfg = tiny_cfg("model.user_offset=true", "model.user_offset_init=mean", "model.dropout=0")
    user, meta = _user(cfg)
    own_mean = float(np.mean(user.data.train_values))
    assert user.state.offset == pytest.approx(own_mean - meta.scale.midpoint, abs=1e-6)
    assert _user(tiny_cfg("model.user_offset=true"))[0].state.offset == 0.0  # "zero": as before
    # a model whose dot products are 0 (zero weights, rows and embedding) predicts the user's own mean
    model = build_model(cfg.model, meta.scale.midpoint).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "bias":
                p.zero_()
    user.state.embedding[:] = 0.0
    rows = np.zeros((user.state.anonymity_ids.size, row_width(cfg.model)), np.float32)
    sse, _, n = evaluate_user(model, user.state, user.data, rows, meta.scale.low, meta.scale.high)
    assert n == user.data.test_items.size > 0
    assert sse == pytest.approx(float(np.sum((own_mean - user.data.test_values) ** 2)), rel=1e-5)
    with pytest.raises(ConfigError, match="user_offset_init"):
        tiny_cfg("model.user_offset_init=mean")  # without a private offset there is nothing to start
    with pytest.raises(ConfigError, match="user_offset_init"):
        tiny_cfg("model.user_offset=true", "model.user_offset_init=median")


def _papers_prediction(model, user_x: torch.Tensor, train_x: torch.Tensor, query_x: torch.Tensor | None = None):
    """The paper's r_hat(u, i) = <h_u, h_i> + b, written out from the model's encoder alone (one star graph):
    no item-bias column, no offset. (train predictions, query predictions)."""
    t = train_x.shape[0]
    batch = build_star_batch([t], None if query_x is None else [query_x.shape[0]])
    h = model.encoder(torch.cat([user_x, train_x, *([] if query_x is None else [query_x])]), batch.edge_index)
    pred = (h[0] * h[1:]).sum(-1) + model.bias
    return pred[:t], pred[t:]


def test_with_both_options_off_the_device_computes_the_papers_model(tiny_cfg):
    """model.item_bias = false and model.user_offset_init = "zero" leave the paper's model: rows of width d, a
    private offset starting at 0, and the device's gradients and test errors those of r_hat = <h_u, h_i> + b
    computed by hand from the encoder (a switch that did anything when off would move them)."""
    cfg = tiny_cfg("model.item_bias=false", "model.user_offset=true", "model.user_offset_init=zero", *BIAS[1:])
    d = cfg.model.dim
    user, meta = _user(cfg)
    assert row_width(cfg.model) == d and user.state.offset == 0.0
    assert user.state.offset != _user(tiny_cfg("model.user_offset=true", "model.user_offset_init=mean"))[0].state.offset
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    assert tuple(server.items.shape) == (meta.num_items, d)
    server.register(user.user, user.register())
    rows = server.rows_for(user.user)
    assert rows.shape == (user.state.anonymity_ids.size, d)
    model, data = server.model, user.data
    step = local_gradients(user.cfg, model, user.state, data, rows, np.random.default_rng(1))

    # by hand: the mean squared error of the paper's predictions over all the user's ratings (one mini-batch)
    assert data.train_items.size <= cfg.local.batch_size
    items_x = torch.tensor(rows[np.searchsorted(user.state.anonymity_ids, data.train_items)], requires_grad=True)
    pred, _ = _papers_prediction(model.train(), torch.from_numpy(user.state.embedding[None]), items_x)
    loss = ((pred - torch.from_numpy(data.train_values)) ** 2).mean()
    *model_grads, row_grads = torch.autograd.grad(loss, [*model.parameters(), items_x])
    assert len(step.model_grads) == len(model_grads)
    for got, want in zip(step.model_grads, model_grads):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(step.real_rows, row_grads.numpy(), rtol=1e-4, atol=1e-6)
    assert step.loss == pytest.approx(float(loss.detach()), rel=1e-5)

    # and its test errors: the same predictions, clipped to the scale, no offset added
    lo, hi = meta.scale.low, meta.scale.high
    with torch.no_grad():
        query = torch.from_numpy(rows[np.searchsorted(user.state.anonymity_ids, data.test_items)])
        _, query_pred = _papers_prediction(model.eval(), torch.from_numpy(user.state.embedding[None]),
                                           torch.from_numpy(rows[np.searchsorted(user.state.anonymity_ids,
                                                                                 data.train_items)]), query)
    err = np.clip(query_pred.numpy().astype(np.float64), lo, hi) - data.test_values
    sse, sae, n = evaluate_user(model, user.state, data, rows, lo, hi)
    assert n == data.test_items.size > 0
    assert sse == pytest.approx(float(np.sum(err**2)), rel=1e-5) and sae == pytest.approx(float(np.abs(err).sum()),
                                                                                          rel=1e-5)


def test_with_both_options_on_a_quickstart_run_changes(tmp_path):
    """The switches do something when on: the same seeded quickstart run ends at another (finite) RMSE."""
    def run(*extra: str) -> float:
        cfg = load_config("quickstart", None, [f"data.cache_dir={tmp_path}", "federation.rounds=4",
                                               "federation.eval_every=4", "federation.clients_per_round=48",
                                               f"simulation.device_secrets={fixed_secrets(tmp_path)}", *extra])
        return run_in_process(cfg, log_every=0)["rmse"]

    default = run()
    both = run("model.item_bias=true", "model.user_offset=true", "model.user_offset_init=mean")
    assert math.isfinite(default) and math.isfinite(both) and both != default
