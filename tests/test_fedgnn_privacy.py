"""FedGNN privacy properties, checked on what the client actually uploads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from clients.fedgnn import FedGNNClient
from fedrec_flwr.audit.attacks import (
    AUDIT_ROW_STD,
    FEATURES,
    model_gradient_auc,
    popularity_reidentification,
    within_upload_auc,
)
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.local_step import local_gradients
from fedrec_flwr.fedgnn.protocol import (
    PHASE_REGISTER,
    PHASE_TRAIN,
    REGISTER_FIELDS,
    TRAIN_FIELDS,
    frame_download,
    model_gradients,
    split_users,
)
from fedrec_flwr.fedgnn.user import DeviceSections, MemoryStore, init_user_state
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.privacy import clip_linf, privatize, pseudo_gradient_rows
from tests.conftest import TEST_SECRET


def _setup(cfg):
    parts = UserPartitions(prepare_partitions(cfg.data))
    return parts, parts.meta


def _payload(cfg, meta, state, seed=0):
    model = build_model(cfg.model, meta.scale.midpoint)
    rng = np.random.default_rng(seed)
    weights = [p.detach().numpy() for p in model.parameters()]
    rows = (rng.standard_normal((state.anonymity_ids.size, cfg.model.dim)) * 0.1).astype(np.float32)
    return weights, rows


def test_clipping_bound_holds_before_noise():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 40)) * 3
    assert np.abs(clip_linf(x, 0.1)).max() <= 0.1
    no_noise = privatize([x], 0.1, 1e-12, rng)[0]
    assert np.abs(no_noise).max() <= 0.1 + 1e-6


def test_noise_is_laplace_with_scale_lambda():
    rng = np.random.default_rng(1)
    zeros = np.zeros(20000, np.float32)
    noise = privatize([zeros], 0.1, 0.2, rng)[0]
    assert stats.kstest(noise, "laplace", args=(0.0, 0.2)).pvalue > 0.01
    assert stats.kstest(noise, "laplace", args=(0.0, 0.3)).pvalue < 1e-6  # the test has power


def test_pseudo_rows_match_real_moments():
    rng = np.random.default_rng(2)
    real = rng.standard_normal((400, 6)) @ np.diag([1, 2, 3, 1, 1, 5]) + 0.5
    for rows in (real, real[:4]):  # more rows than dimensions (Cholesky route) and fewer (random mix of rows)
        fake = pseudo_gradient_rows(np.random.default_rng(3), torch.from_numpy(rows.astype(np.float32)), 20000).numpy()
        cov = np.cov(rows.T, bias=True)
        assert fake.dtype == np.float32 and np.allclose(fake.mean(0), rows.mean(0), atol=0.1)
        assert np.trace(np.cov(fake.T)) == pytest.approx(np.trace(cov), rel=0.05)  # shrinkage keeps the total variance
    # with 400 rows in 6 dimensions Ledoit-Wolf barely shrinks: the covariance is the rows' own
    fake = pseudo_gradient_rows(np.random.default_rng(3), torch.from_numpy(real.astype(np.float32)), 20000).numpy()
    assert np.allclose(np.cov(fake.T), np.cov(real.T), atol=0.15 * np.abs(np.cov(real.T)).max())


def test_upload_hides_embedding_ratings_and_count(tiny_cfg):
    cfg = tiny_cfg()
    parts, meta = _setup(cfg)
    data = parts.user(5)
    store = MemoryStore()
    client = FedGNNClient(cfg, meta, [5], parts.user, store, secret=TEST_SECRET)
    reg, n, reg_metrics = client.fit([], {"phase": PHASE_REGISTER, "round": 1})
    assert n == 1 and reg[0].tolist() == [5]  # [users, set sizes, the ids of user 5]
    ids = [split_users(reg, REGISTER_FIELDS)[0][1][0]]
    assert np.all(np.isin(data.train_items, ids[0])) and ids[0].size >= cfg.privacy.pseudo_items
    assert ids[0].size >= 2 * data.train_items.size  # at least as many pseudo rows as real ones
    weights, rows = _payload(cfg, meta, store.load(5))
    upload, n, metrics = client.fit(frame_download(weights, [5], [rows]), {"phase": PHASE_TRAIN, "round": 2})
    emb = store.load(5).embedding
    assert n == 1 and set(metrics) == {"phase", "epsilon_per_coordinate"}  # no rating count, no loss
    (user, (flat, sent_ids, sent_rows)), = split_users(upload, TRAIN_FIELDS)
    assert user == 5  # the framing names the user, whom the server knows anyway
    assert np.array_equal(sent_ids, np.sort(sent_ids))  # ids sorted: position marks nothing
    floats = [np.ravel(a).astype(np.float64) for a in upload if np.issubdtype(np.asarray(a).dtype, np.floating)]
    ints = [a for a in upload if np.issubdtype(np.asarray(a).dtype, np.integer)]
    n_set = store.load(5).anonymity_ids.size  # ints: the user, the block sizes (public shapes) and the registered set
    assert len(ints) == 5 and [upload[i].tolist() for i in (0, 1, 3, 5)] == [[5], [flat.size], [n_set], [n_set]]
    assert np.array_equal(upload[4], store.load(5).anonymity_ids)
    values = np.concatenate(floats)
    assert not np.isin(np.round(emb, 5), np.round(values, 5)).any(), "user embedding values appear in the upload"
    for secret in (data.train_values, data.test_values):
        window = secret.size
        for f in floats:
            if f.size >= window:
                strided = np.lib.stride_tricks.sliding_window_view(f, window)
                assert not np.all(np.isclose(strided, secret), axis=1).any(), "ratings appear in the upload"
    assert metrics["epsilon_per_coordinate"] == pytest.approx(2 * 0.1 / 0.2)


@pytest.mark.parametrize("protocol", [(), ("privacy.pseudo_sampler=popularity", "privacy.popularity_bins=10"),
                                      ("local.upload=delta", "local.steps=3", "local.lr=0.01"),
                                      ("model.gnn=ggnn", "model.biases=true", "local.loss=sum",
                                       "local.batch_size=1000")])
def test_attacker_cannot_separate_real_from_pseudo_rows(tiny_cfg, protocol):
    """The server ranks the rows of each upload by every feature; mean within-upload AUC must stay <= 0.6.
    With `fedgnn_tuned`'s model and loss (GGNN with biases, summed) the features include each row's projection on the
    item-bias map w the server sent (at a trained map's scale), the direction an item's own term w.x_i adds to its
    real rows' gradients.

    The attack works inside one upload, as the server would: it knows whose upload it holds
    and wants that user's rated items. (Pooling rows of different users' uploads mixes users
    whose real-to-pseudo ratio and gradient scale differ, which says nothing about any one user.)
    """
    auc = within_upload_auc(tiny_cfg("model.dim=64", "privacy.pseudo_items=40", *protocol), 60, "protected")
    assert np.all(auc <= 0.6), dict(zip(FEATURES, np.round(auc, 3)))


def test_attack_has_power_against_naive_padding(tiny_cfg):
    """The same attacker does find the real rows when pseudo rows are zeros: the test above can fail."""
    auc = within_upload_auc(tiny_cfg("model.dim=64", "privacy.pseudo_items=40", "privacy.ldp=false"), 30, "zeros")
    assert auc.max() > 0.9


@pytest.mark.parametrize("model", [
    (), ("model.gnn=ggnn", "model.biases=true", "data.item_features=true"),
    ("model.gnn=ggnn", "model.biases=true", "local.loss=sum", "local.batch_size=1000", "model.dim=256")])
def test_the_model_gradient_does_not_point_at_the_real_items_under_ldp(tiny_cfg, model):
    """The model gradient sums over the real items too. Matching its top singular directions
    against the rows the server sent (and, with public item features, the feature map's gradient
    against features x uploaded rows) finds them without LDP; with LDP it must stay <= 0.6.
    With `fedgnn_tuned`'s summed loss too: under LDP the device keeps the mean loss's weight gradients (scaled by
    the count of ratings, as the rows are, they scored 0.85 here).
    The item-bias map's gradient (w of w.x_j: model.biases) is a sum of c_j x_j over the real
    items: without the pseudo items' terms its projections on the sent rows, alone or times the uploaded rows' part
    along w, found them (0.67 and 0.75 on fedgnn_tuned's model under LDP, 0.88 without LDP); with them, <= 0.6."""
    sizes = ("model.dim=64", "data.synthetic.num_items=200", "data.synthetic.mean_degree=15",
             "privacy.pseudo_items=100", *model)
    open_auc = model_gradient_auc(tiny_cfg(*sizes, "privacy.ldp=false"), 30)
    assert open_auc["sent rows vs weight gradients"] > 0.7, open_auc  # the attack has power
    protected = model_gradient_auc(tiny_cfg(*sizes), 30)
    assert max(protected.values()) <= 0.6, protected
    if "data.item_features=true" in model:
        assert open_auc["feature map"] > 0.65 and "feature map" in protected
    if "model.biases=true" in model:  # the map attacks have power once the pseudo terms are left out
        bare = model_gradient_auc(tiny_cfg(*sizes, "privacy.ldp=false"), 30, map_terms=False)
        assert bare["sent rows vs map gradients"] > 0.7 and bare["map gradient vs uploaded row"] > 0.7, bare
        assert max(open_auc["sent rows vs map gradients"], open_auc["map gradient vs uploaded row"]) <= 0.6, open_auc


def test_the_item_bias_maps_gradient_is_its_slopes_times_the_rated_items_inputs(tiny_cfg):
    """The pseudo items' map terms imitate c_j x_j; that holds only if the slopes c_j the device records are the
    ones its map's gradient is made of: the gradient of w equals the sum over the rated items of c_j
    times their inputs, to float rounding, with public item features and several local steps too."""
    cfg = tiny_cfg("model.gnn=ggnn", "model.biases=true", "local.loss=sum", "local.batch_size=4", "local.steps=3",
                   "model.population_bias=true", "data.item_features=true")
    parts, meta = _setup(cfg)
    device_cfg = DeviceSections.from_config(cfg)
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
    with torch.no_grad():
        model.item_bias_map.normal_(0.0, 0.1)
    checked = 0
    for u in range(meta.num_users):
        data = parts.user(u)
        if data.train_items.size < 5:
            continue
        state = init_user_state(device_cfg, meta, data)
        sent = (np.random.default_rng(u).standard_normal((state.anonymity_ids.size, cfg.model.dim)) * 0.1).astype(
            np.float32)
        step = local_gradients(device_cfg, model, state, data, sent, np.random.default_rng(100 + u))
        assert step.maps is not None and step.maps.inputs.shape == (state.anonymity_ids.size, cfg.model.dim)
        real = np.searchsorted(state.anonymity_ids, data.train_items)
        rebuilt = step.maps.coefs @ step.maps.inputs[real]
        np.testing.assert_allclose(rebuilt, step.model_grads[step.maps.at], rtol=1e-4, atol=1e-6)
        checked += 1
        if checked == 5:
            break
    assert checked == 5


@pytest.mark.xfail(strict=True, reason=(
    "known break (docs/benchmarks/privacy-measurements.md, 'What a server that crafts its downloads reads'): scaled "
    "up to the per-coordinate clip, a weight gradient's sign pattern survives the noise; no device check bounds it"))
@pytest.mark.parametrize("crafted,row_std", [((), 1.0), (("privacy.clip_delta=0.001", "privacy.noise_lambda=0.002"),
                                                        AUDIT_ROW_STD)])
def test_a_server_that_crafts_its_downloads_cannot_read_the_real_items_off_the_weight_gradients(tiny_cfg, crafted,
                                                                                                  row_std):
    """A hostile server sends the rows at 10 times their scale, or asks for a 100 times smaller clip with noise to
    match (the same epsilon per coordinate, which every device accepts). Either makes even the mean loss's weight
    gradients fill the clip. Strict expected failure (about 0.85): it fails once a fix makes it hold."""
    cfg = tiny_cfg("model.dim=64", "data.synthetic.num_items=200", "data.synthetic.mean_degree=15",
                   "privacy.pseudo_items=100", "model.gnn=ggnn", "model.biases=true", "local.loss=sum",
                   "local.batch_size=1000", *crafted)
    assert model_gradient_auc(cfg, 30, row_std=row_std)["sent rows vs weight gradients"] <= 0.6


def test_popularity_attack_pairs_tokens_with_items_by_rank():
    """Distinct counts known exactly: every token re-identified; unrelated popularity: about chance."""
    rng = np.random.default_rng(0)
    observed = rng.permutation(np.arange(1, 201)).astype(float)
    assert popularity_reidentification(observed, observed, rng) == 1.0
    assert popularity_reidentification(observed, observed[::-1].copy(), rng) < 0.05
    ties = np.ones(200)  # all counts equal: ties broken at random, so top-10 hits are rare
    assert popularity_reidentification(ties, ties, rng, top=10) <= 0.2


def test_a_user_without_training_ratings_sends_a_valid_upload(tiny_cfg):
    """Real datasets have such users (one in Douban's split): their upload must pass validation, not carry NaN."""
    from fedrec_flwr.data import UserData
    from fedrec_flwr.fedgnn.server import FedGNNServer

    cfg = tiny_cfg()
    parts, meta = _setup(cfg)
    empty = UserData(7, np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32))
    store = MemoryStore()
    client = FedGNNClient(cfg, meta, [7], lambda u: empty, store, secret=TEST_SECRET)
    reg, _, _ = client.fit([], {"phase": PHASE_REGISTER, "round": 1})
    ids = split_users(reg, REGISTER_FIELDS)[0][1][0]
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    server.register(7, ids)
    download = frame_download(server.model_weights(), [7], [server.rows_for(7)])
    upload, _, _ = client.fit(download, {"phase": PHASE_TRAIN, "round": 2})
    (_, (flat, sent_ids, rows)), = split_users(upload, TRAIN_FIELDS)
    # UploadRejected on NaN/Inf
    update = server.validate(7, [*model_gradients(flat, server.model_shapes), sent_ids, rows])
    assert update.rows.shape == (ids.size, cfg.model.dim) and np.isfinite(update.rows).all()
