"""The FedGNN server: merging maths and rejection of malformed updates."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.fedgnn.protocol import frame_registration, frame_users, model_gradients, split_users
from fedrec_flwr.fedgnn.rounds import validate_registration
from fedrec_flwr.fedgnn.server import merge_item_gradients, validate_upload
from fedrec_flwr.messages import UploadRejected

SHAPES = [(3, 2), ()]


def good(ids=np.array([1, 4, 7])):
    return [np.ones((3, 2), np.float32), np.float32(0.5), ids, np.zeros((ids.size, 4), np.float32)]


def test_merge_divides_by_clients_or_count():
    a = (np.array([0, 2]), np.array([[1.0, 1.0], [2.0, 2.0]], np.float32))
    b = (np.array([2, 3]), np.array([[4.0, 4.0], [6.0, 6.0]], np.float32))
    ids, rows = merge_item_gradients([a, b], 5, 2, "clients")
    assert ids.tolist() == [0, 2, 3] and np.allclose(rows[:, 0], [0.5, 3.0, 3.0])
    ids, rows = merge_item_gradients([a, b], 5, 2, "count")
    assert np.allclose(rows[:, 0], [1.0, 3.0, 6.0])


def test_valid_upload_passes():
    grads, ids, rows = validate_upload(good(), SHAPES, 4, 10, 3, np.array([1, 4, 7]))
    assert ids.tolist() == [1, 4, 7] and rows.shape == (3, 4)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda u: u.__setitem__(0, np.full((3, 2), np.nan, np.float32)), "NaN/Inf"),
        (lambda u: u.__setitem__(3, np.full((3, 4), np.inf, np.float32)), "NaN/Inf"),
        (lambda u: u.__setitem__(0, np.ones((2, 2), np.float32)), "shape"),
        (lambda u: u.__setitem__(3, np.ones((3, 5), np.float32)), "shape"),
        (lambda u: u.__setitem__(2, np.array([1, 1, 7])), "duplicate"),
        (lambda u: u.__setitem__(2, np.array([1, 4, 70])), "out of range"),
        (lambda u: u.pop(), "expected 4 arrays"),
    ],
)
def test_malformed_uploads_are_rejected(mutate, reason):
    upload = good()
    mutate(upload)
    with pytest.raises(UploadRejected, match=reason):
        validate_upload(upload, SHAPES, 4, 10, 3, None)


def test_too_few_rows_and_changed_set_rejected():
    with pytest.raises(UploadRejected, match="fewer than the required 5"):
        validate_upload(good(), SHAPES, 4, 10, 5, None)
    with pytest.raises(UploadRejected, match="differ from the anonymity set"):
        validate_upload(good(), SHAPES, 4, 10, 3, np.array([1, 4, 8]))
    with pytest.raises(UploadRejected, match="fewer than the required"):
        validate_registration(frame_registration([0], [np.array([1, 2])], [1]), 10, 3)


def test_a_forged_frame_is_refused_before_any_user_is_read():
    users, sizes, ids = frame_users([0, 1], [[np.array([1, 2, 3])], [np.array([4, 5, 6])]], 1)
    assert [(u, b[0].tolist()) for u, b in split_users([users, sizes, ids], 1)] == [(0, [1, 2, 3]), (1, [4, 5, 6])]
    counts = frame_registration([0, 1], [np.array([1, 2, 3]), np.array([4, 5, 6])], [1, 1])[3:]
    for forged, why in (([users, sizes + [1, 0], ids], "do not add up"),
                        ([users, np.array([-1, 7]), ids], "do not add up"),
                        ([users, np.array([9, -3]), ids], "do not add up"),
                        ([users, sizes[:1], ids], "sizes must be 2"),
                        ([users, sizes.astype(float), ids], "sizes must be 2 integers"),
                        ([np.array([0, 0]), sizes, ids], "duplicate user ids"), ([users, sizes], "must have 5 arrays"),
                        # int64 sum wraps
                        ([users.astype(float), sizes, ids], "integer array of user ids"),
                        ([users, sizes, np.array(7)], "do not add up"),
                        ([np.arange(17), np.full(17, 2**60), np.empty((2**60, 0), np.float32)], "do not add up")):
        with pytest.raises(UploadRejected, match=why):
            validate_registration(forged if len(forged) < 3 else [*forged, *counts], 10, 3)


def test_flat_model_gradients_must_have_the_models_length():
    flat = np.arange(2 * 3 + 4, dtype=np.float32)
    grads = model_gradients(flat, [(2, 3), (4,)])
    assert [g.shape for g in grads] == [(2, 3), (4,)] and grads[1].tolist() == [6, 7, 8, 9]
    for bad in (flat[:-1], flat.reshape(2, 5), np.append(flat, 1.0)):
        with pytest.raises(UploadRejected, match="model gradients have shape"):
            model_gradients(bad, [(2, 3), (4,)])


def test_server_step_does_not_depend_on_arrival_order(tiny_cfg):
    """Flower delivers results in any order; the model after a round must be the same bits regardless."""
    import torch

    from fedrec_flwr.fedgnn.server import FedGNNServer, TrainUpdate

    cfg = tiny_cfg()
    rng = np.random.default_rng(3)
    num_items = 80
    first = FedGNNServer.from_config(cfg, num_items, 3.0)
    shapes = [w.shape for w in first.model_weights()]
    updates = []
    for user in range(12):
        ids = np.sort(rng.choice(num_items, 40, replace=False)).astype(np.int64)
        grads = [(rng.standard_normal(s) * 10.0 ** rng.integers(-4, 2)).astype(np.float32) for s in shapes]
        updates.append(TrainUpdate(user, grads, ids, rng.standard_normal((40, cfg.model.dim)).astype(np.float32)))
    results = []
    for order in (updates, updates[::-1], [updates[i] for i in rng.permutation(12)]):
        torch.manual_seed(0)
        server = FedGNNServer.from_config(cfg, num_items, 3.0)
        server.apply(order)
        results.append([*server.model_weights(), server.items.detach().numpy().copy()])
    for other in results[1:]:
        assert len(other) == len(results[0]) and all(np.array_equal(a, b) for a, b in zip(results[0], other))
    start = [*first.model_weights(), first.items.detach().numpy()]  # the round did move the model and the table
    assert not np.array_equal(start[-1],
                              results[0][-1]) and any(not np.array_equal(a, b) for a, b in zip(start, results[0]))


def _push_items(server, signs):
    """Apply one update per sign: every model gradient and item row equal to that sign."""
    from fedrec_flwr.fedgnn.server import TrainUpdate

    shapes = [w.shape for w in server.model_weights()]
    ids = np.arange(40, dtype=np.int64)
    for sign in signs:
        server.apply([TrainUpdate(0, [np.full(s, sign, np.float32) for s in shapes], ids,
                                  np.full((40, server.row_width), sign, np.float32))])


def test_item_table_takes_its_own_learning_rate(tiny_cfg):
    """server_opt.item_lr moves the item rows at its own rate; the model keeps server_opt.lr."""
    from fedrec_flwr.fedgnn.server import FedGNNServer

    base = tiny_cfg("server_opt.name=sgd", "server_opt.lr=0.01")
    fast = tiny_cfg("server_opt.name=sgd", "server_opt.lr=0.01", "server_opt.item_lr=0.05")
    moves = []
    for cfg in (base, fast):
        server = FedGNNServer.from_config(cfg, 80, 3.0)
        before = server.items.detach().clone()
        _push_items(server, [1.0])
        moves.append(float((before - server.items.detach()).abs().max()))
    assert moves[0] == pytest.approx(0.01, rel=1e-5) and moves[1] == pytest.approx(0.05, rel=1e-5)


def test_lr_decay_shrinks_both_rates_after_every_round(tiny_cfg):
    """server_opt.lr_decay = g: round r moves by lr * g^(r-1), for the model and the item table."""
    from fedrec_flwr.fedgnn.server import FedGNNServer

    server = FedGNNServer.from_config(tiny_cfg("server_opt.name=sgd", "server_opt.lr=0.01", "server_opt.item_lr=0.05",
                                               "server_opt.lr_decay=0.5"), 80, 3.0)
    moves = []
    for _ in range(3):
        items, model = server.items.detach().clone(), server.model_weights()
        _push_items(server, [1.0])
        moves.append((float((items - server.items.detach()).abs().max()),
                      float(max(np.abs(a - b).max() for a, b in zip(model, server.model_weights())))))
    np.testing.assert_allclose(moves, [(0.05, 0.01), (0.025, 0.005), (0.0125, 0.0025)], rtol=1e-4)


def test_item_weight_decay_shrinks_every_row_at_the_current_item_rate(tiny_cfg):
    """server_opt.item_weight_decay = w: each round scales all item rows by 1 - item_rate * w (the rate
    after lr_decay), whether or not the round touched them; the model's weights are not decayed."""
    from fedrec_flwr.fedgnn.server import FedGNNServer

    server = FedGNNServer.from_config(tiny_cfg("server_opt.name=sgd", "server_opt.lr=0.01", "server_opt.item_lr=0.05",
                                               "server_opt.lr_decay=0.5", "server_opt.item_weight_decay=2"), 80, 3.0)
    start, model = server.items.detach().clone(), server.model_weights()
    _push_items(server, [0.0, 0.0])  # zero gradients: only the decay moves anything
    np.testing.assert_allclose(server.items.detach().numpy(), start.numpy() * (1 - 0.05 * 2) * (1 - 0.025 * 2),
                               rtol=1e-5)
    for a, b in zip(model, server.model_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("beta1", [0.9, 0.99])
def test_item_beta1_sets_how_long_adam_remembers_an_item_row_gradient(tiny_cfg, beta1):
    """Gradient +1 then -1: the second Adam step undoes only the share of the first that beta1 forgets."""
    from fedrec_flwr.fedgnn.server import FedGNNServer

    server = FedGNNServer.from_config(tiny_cfg("server_opt.name=adam", "server_opt.lr=0.01",
                                               f"server_opt.item_beta1={beta1}"), 80, 3.0)
    start = server.items.detach().clone()
    _push_items(server, [1.0, -1.0])
    m_hat = (beta1 * (1 - beta1) - (1 - beta1)) / (1 - beta1**2)  # bias-corrected first moment after +1, -1
    v_hat = 1.0  # squares are both 1
    expected = -0.01 * (1.0 + m_hat / np.sqrt(v_hat))
    np.testing.assert_allclose((server.items.detach() - start)[:40].numpy(), expected, rtol=1e-4)
