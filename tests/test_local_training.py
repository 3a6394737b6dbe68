"""Local training per upload (local.upload = "delta"): several SGD steps on the device, one protected upload."""

from __future__ import annotations

import numpy as np
import torch

from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.local_step import local_gradients, train_users
from fedrec_flwr.fedgnn.user import DeviceSections, init_user_state
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.privacy import clip_linf


def _step(cfg, user: int = 3):
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta, data = parts.meta, parts.user(user)
    torch.manual_seed(0)
    model = build_model(cfg.model, meta.scale.midpoint)
    state = init_user_state(DeviceSections.from_config(cfg), meta, data)
    # the rows of its anonymity set (LDP), or of the whole table (user-level DP registers none)
    count = state.anonymity_ids.size if cfg.privacy.mode == "ldp" else meta.num_items
    rows = (np.random.default_rng(1).standard_normal((count, cfg.model.dim)) * 0.1).astype(np.float32)
    step = local_gradients(DeviceSections.from_config(cfg), model, state, data, rows, np.random.default_rng(2))
    return step.model_grads, step.real_rows, step.loss, model, data


def test_one_local_step_uploads_exactly_the_clipped_gradient(tiny_cfg):
    plain = _step(tiny_cfg("model.dropout=0", "local.batch_size=1000"))
    delta = _step(tiny_cfg("model.dropout=0", "local.batch_size=1000", "local.upload=delta", "local.lr=0.05"))
    for a, b in zip([*plain[0], plain[1]], [*delta[0], delta[1]]):
        np.testing.assert_array_equal(clip_linf(a, 0.1), b)  # the upload's own clip makes them equal


def test_local_steps_follow_the_users_own_progress(tiny_cfg):
    """Gradient uploads average steps at the downloaded weights; delta uploads train a local copy, whose
    full-batch loss falls step after step (the mean loss over the steps is below the gradient mode's)."""
    common = ("model.dropout=0", "local.batch_size=1000", "local.steps=5")
    plain = _step(tiny_cfg(*common, "local.user_lr=1e-9"))
    delta = _step(tiny_cfg(*common, "local.user_lr=1e-9", "local.upload=delta", "local.lr=0.05"))
    assert delta[2] < plain[2] - 1e-3, (delta[2], plain[2])
    assert not np.allclose(plain[1], delta[1])  # the rows' gradients moved along the path
    assert all(np.all(np.isfinite(g)) for g in delta[0])


def test_private_offset_learns_the_users_level_and_stays_on_the_device(tiny_cfg):
    """model.user_offset: a scalar per user, trained locally, kept in the device's store, never uploaded."""
    from flwr.app import RecordDict

    from clients.user_store import NodeStateStore
    from fedrec_flwr.fedgnn.user import FedGNNUser

    cfg = tiny_cfg("model.dropout=0", "local.batch_size=1000", "local.user_steps=20", "local.user_lr=0.1",
                   "model.user_offset=true", "privacy.ldp=false")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    data = parts.user(3)
    data.train_values[:] = meta.scale.high  # a user who rates everything at the top of the scale
    store = NodeStateStore(RecordDict())
    user = FedGNNUser(DeviceSections.from_config(cfg), meta, data, store)
    weights = [p.detach().numpy().copy() for p in user.model.parameters()]
    rows = np.zeros((user.state.anonymity_ids.size, cfg.model.dim), np.float32)
    upload = train_users([user], weights, [rows], 2)[0]
    offset = store.load(3).offset
    assert offset > 0.5  # the model predicts the scale midpoint; the offset carries the user's level
    assert len(upload) == len(weights) + 2  # model gradients, ids, rows: nothing else leaves the device
    assert not any(np.isclose(a, offset).any() for a in upload if a.dtype.kind == "f")


def test_a_summed_loss_scales_the_weight_gradients_only_where_the_server_never_sees_one_upload(tiny_cfg):
    """local.loss = "sum" multiplies the uploaded item rows by the user's rating count in both modes. The model
    weights' gradients get it only under user-level DP, where one user's update is seen only inside a noisy sum:
    under the paper's LDP they keep the mean loss's, whatever the run config asks, since a summed loss's weight
    gradients saturate the per-coordinate clip and show the server the rated rows (tests/test_fedgnn_privacy.py)."""
    common = ("model.dropout=0", "local.batch_size=1000", "model.gnn=ggnn", "model.biases=true")
    for mode, weights_scaled in (("ldp", False), ("user_dp", True)):
        mean = _step(tiny_cfg(*common, f"privacy.mode={mode}"))
        summed = _step(tiny_cfg(*common, f"privacy.mode={mode}", "local.loss=sum"))
        n = mean[4].train_items.size
        np.testing.assert_allclose(summed[1], n * mean[1], rtol=1e-5, atol=1e-7)  # the rows: n times
        for a, b in zip(mean[0], summed[0]):
            np.testing.assert_allclose(b, n * a if weights_scaled else a, rtol=1e-5, atol=1e-7)
        assert any(np.abs(a).max() > 0 for a in mean[0])  # a weight gradient to compare
