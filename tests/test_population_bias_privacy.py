"""b_pop (model.population_bias) as a server would attack it: the one upload coordinate that carries a user's mean
rating residual, 2 mean(b_pop + t_i - r), times whatever weight at most 1 the device gives the user's pull.

The attacker holds everything the server holds: the run config, the model and rows it downloads (its own choice),
and every message it receives, parsed as the server parses it (`split_users`, `model_gradients`). The devices hold
their own secrets (`DeviceSecret`), which the attacker does not.

- LDP mode: two neighbouring users (the same items, every rating at the scale's low end against every rating at its
  high end: their b_pop gradients lie as far apart as they can) upload through the real device code path
  (`FedGNNClient.fit`); the best threshold test on the b_pop coordinate must not show a privacy loss above the
  per-coordinate epsilon the device reports (2 delta / lambda), with a Clopper-Pearson margin. The same audit, on the
  same uploads without their Laplace noise, separates the two users completely: the test can fail.
- Whatever model, rows and admitted config the server picks, the b_pop coordinate stays within the clip before noise.
- User-level DP: a download that leaves b_pop the only non-zero coordinate of a user's update still gets that update
  clipped to C whole: b_pop is inside the clipped update, not beside it.
- In the LDP mode a download within the device's bound that overflows the local step of exactly the users who rated a
  chosen item must not mark them: an overflowed step is sent as no step (NaN passes clip and noise), its private state
  is kept, and its evaluation stays finite.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from scipy import stats

from clients.fedgnn import FedGNNClient
from fedrec_flwr.config import ConfigError, from_run_config, load_config
from fedrec_flwr.data import UserData, UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.accounting import epsilon_per_coordinate
from fedrec_flwr.fedgnn.protocol import (
    PHASE_REGISTER,
    PHASE_TRAIN,
    REGISTER_FIELDS,
    TRAIN_FIELDS,
    frame_download,
    model_gradients,
    split_users,
)
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.user import DOWNLOAD_BOUND, DeviceSections, FedGNNUser, MemoryStore
from fedrec_flwr.fedgnn.user_dp import node_update
from fedrec_flwr.metrics import squared_error_sum
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.privacy import ldp as ldp_module
from fedrec_flwr.privacy.device_secret import DeviceSecret
from tests.conftest import fixed_secrets

B_POP = ("model.population_bias=true", "model.personal_shrink=5")
# the tuned preset's model and loss (GGNN, both bias maps, item biases, the summed loss over every rating)
TUNED_LIKE = ("model.gnn=ggnn", "model.biases=true", "model.item_bias=true", "local.loss=sum", "local.batch_size=1000")
ITEMS = np.arange(0, 16, 2, dtype=np.int64)  # the 8 items both neighbouring users rated
AUDIT_UPLOADS = 4000  # uploads of each neighbour
ALPHA = 1e-6  # the audit's false-alarm probability, over all its thresholds together
THRESHOLDS = np.linspace(-0.6, 0.6, 25)  # 3 lambda either side of 0: past them an event's counts carry no margin


def _secret(label: str) -> DeviceSecret:
    """A fixed device secret per world (reproducible), never the TEST_SECRET the other tests share."""
    return DeviceSecret(hashlib.sha256(f"b_pop audit {label}".encode()).digest())


def _rated(user: int, rating: float, items: np.ndarray = ITEMS) -> UserData:
    return UserData(user, items, np.full(items.size, rating, np.float32), np.zeros(0, np.int64),
                    np.zeros(0, np.float32))


def _b_pop_at(cfg, meta) -> int:
    names = [name for name, _ in build_model(cfg.model, meta.scale.midpoint, meta.num_item_features).named_parameters()]
    return names.index("population_bias")


def _server_view(cfg, meta, rating: float, users: int, label: str, weights=None, table=None) -> np.ndarray:
    """The b_pop coordinate of `users` uploads of a user who rated ITEMS all at `rating`, as the server parses them:
    one node hosting `users` copies of that user (each its own id, so each draws from its own secure stream), the
    device's secret unknown to the server; the download is the server's (its fresh model and table unless given)."""
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    weights = server.model_weights() if weights is None else weights
    table = server.table() if table is None else table
    ids = list(range(users))
    client = FedGNNClient(cfg, meta, ids, lambda u: _rated(u, rating), MemoryStore(), secret=_secret(label))
    reg, _, _ = client.fit([], {"phase": PHASE_REGISTER, "round": 1})
    sets = {u: fields[0] for u, fields in split_users(reg, REGISTER_FIELDS)}
    download = frame_download(weights, ids, [table[np.sort(sets[u])] for u in ids])
    upload, n, metrics = client.fit(download, {"phase": PHASE_TRAIN, "round": 2})
    assert n == users
    if cfg.privacy.ldp:  # the epsilon the device states for every coordinate of its upload
        assert metrics["epsilon_per_coordinate"] == pytest.approx(
            epsilon_per_coordinate(cfg.privacy.clip_delta, cfg.privacy.noise_lambda))
    at = _b_pop_at(cfg, meta)
    out = []
    for _, (flat, _, _) in split_users(upload, TRAIN_FIELDS):
        grads = model_gradients(flat, server.model_shapes)
        out.append(float(np.ravel(grads[at])[0]))
    return np.array(out)


def _clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    low = stats.beta.ppf(alpha / 2, k, n - k + 1) if k > 0 else 0.0
    high = stats.beta.ppf(1 - alpha / 2, k + 1, n - k) if k < n else 1.0
    return float(low), float(high)


def audited_epsilon(y0: np.ndarray, y1: np.ndarray, alpha: float = ALPHA) -> float:
    """The largest privacy loss the best threshold test shows with confidence 1 - alpha: over every threshold t, both
    tails and both orders, log(lower bound of P_a(A) / upper bound of P_b(A)) with Clopper-Pearson intervals at
    alpha split over all the events (Bonferroni). A mechanism that is epsilon-DP on this coordinate keeps it at most
    epsilon, except with probability alpha."""
    events = [(t, above) for t in THRESHOLDS for above in (True, False)]
    each = alpha / (2 * len(events))
    best = -np.inf
    for t, above in events:
        for a, b in ((y0, y1), (y1, y0)):
            ka = int(np.sum(a > t if above else a <= t))
            kb = int(np.sum(b > t if above else b <= t))
            low_a, _ = _clopper_pearson(ka, a.size, each)
            _, high_b = _clopper_pearson(kb, b.size, each)
            if low_a > 0:
                best = max(best, float(np.log(low_a / high_b)))
    return best


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as a ClientApp runs (`client_fn`): on a loaded two-core machine more are far slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def ldp_world(tiny_cfg):
    cfg = tiny_cfg(*B_POP, *TUNED_LIKE)
    meta = UserPartitions(prepare_partitions(cfg.data)).meta
    return tiny_cfg, cfg, meta


def test_the_b_pop_coordinate_of_two_neighbours_uploads_leaks_no_more_than_its_epsilon(ldp_world, monkeypatch):
    """The server's best threshold test on b_pop, between a user whose ratings are all 1 and the same user with all
    5s, over 4000 uploads of each: its audited privacy loss stays within 2 delta / lambda (the device's own figure)
    and comes close to it (the attack is as strong as the guarantee allows, so a larger leak would show). Without the
    Laplace noise the same uploads sit exactly at +delta and -delta, and the same audit finds far more than epsilon."""
    make, cfg, meta = ldp_world
    p = cfg.privacy
    eps = epsilon_per_coordinate(p.clip_delta, p.noise_lambda)
    assert eps == pytest.approx(2 * p.clip_delta / p.noise_lambda)
    assert meta.scale.low < meta.scale.midpoint < meta.scale.high  # b_pop starts at the midpoint: both pulls saturate

    # the raw pulls (LDP off): the mean residual 2 (b_pop - r) = +-4, at a weight of at most 1 (a device never
    # amplifies its pull), far outside the clip either way
    open_cfg = make(*B_POP, *TUNED_LIKE, "privacy.ldp=false")
    for r in (meta.scale.low, meta.scale.high):
        weight = _server_view(open_cfg, meta, r, 3, f"raw {r}") / (2 * (meta.scale.midpoint - r))
        assert np.all((weight > 0) & (weight <= 1 + 1e-6)) and np.all(weight * 4 > 10 * p.clip_delta), weight

    low = _server_view(cfg, meta, meta.scale.low, AUDIT_UPLOADS, "low")
    high = _server_view(cfg, meta, meta.scale.high, AUDIT_UPLOADS, "high")
    assert np.isfinite(low).all() and np.isfinite(high).all()
    audited = audited_epsilon(low, high)
    assert audited <= eps, f"b_pop leaks {audited:.3f} > epsilon {eps:.3f} per coordinate"
    assert audited > 0.5 * eps, f"the audit is too weak to mean anything ({audited:.3f})"
    # the noise is the configured Laplace around the clipped pull, +delta for the low user and -delta for the high one
    for values, centre in ((low, p.clip_delta), (high, -p.clip_delta)):
        assert stats.kstest(values, "laplace", args=(centre, p.noise_lambda)).pvalue > 1e-4

    # the same uploads without their noise: clipped to exactly +-delta (the clip holds before noise), and told apart
    monkeypatch.setattr(ldp_module, "standard_laplace", lambda rng, count: np.zeros(count, np.float32))
    bare_low = _server_view(cfg, meta, meta.scale.low, 200, "bare low")
    bare_high = _server_view(cfg, meta, meta.scale.high, 200, "bare high")
    np.testing.assert_allclose(bare_low, p.clip_delta, rtol=1e-6)
    np.testing.assert_allclose(bare_high, -p.clip_delta, rtol=1e-6)
    assert audited_epsilon(bare_low, bare_high) > 2 * eps


@pytest.mark.parametrize("server_config", [
    (),
    ("model.personal_shrink=0",),  # k weighs the prediction only: the upload is the default's
    ("local.loss=mean", "model.item_bias=false"),  # t_i = w.x_i alone
    ("local.upload=delta", "local.steps=5", "local.lr=10"),  # b_pop's local copy moves between the steps
    ("local.steps=3", "local.batch_size=2"),  # means over small picks
])
def test_no_b_pop_item_terms_or_admitted_config_the_server_picks_lifts_b_pop_past_the_clip(tiny_cfg, monkeypatch,
                                                                                         server_config):
    """b_pop's gradient reads the downloaded b_pop, the items' own terms t_i = w.x_i + b_i (the bias map w and the
    rows, the server's) and the run config's local section (the server's too, within what the config admits). The
    server sets each to the largest value a device accepts (DOWNLOAD_BOUND), b_pop against the items' terms, for the
    largest residual of either sign: before noise the b_pop coordinate of the upload stays finite and within
    [-delta, delta] for both neighbours. k (model.personal_shrink) weighs the prediction only, never the upload; a
    negative k, which would weigh a user's own part by more than 1 (n / (n + k)), is refused by the config every
    device loads."""
    cfg = tiny_cfg(*B_POP, *TUNED_LIKE, *server_config)
    meta = UserPartitions(prepare_partitions(cfg.data)).meta
    delta, dim = cfg.privacy.clip_delta, cfg.model.dim
    at = _b_pop_at(cfg, meta)
    monkeypatch.setattr(ldp_module, "standard_laplace", lambda rng, count: np.zeros(count, np.float32))
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    names = [name for name, _ in server.model.named_parameters()]
    for sign in (1.0, -1.0):
        weights = server.model_weights()
        weights[at] = np.array(-sign * DOWNLOAD_BOUND, np.float32)
        weights[names.index("item_bias_map")][...] = sign * DOWNLOAD_BOUND
        table = server.table()
        table[:, :dim] = np.sign(table[:, :dim]) * sign  # w.x_i = sign * 1e6 * |x_i|_1 ...
        if cfg.model.item_bias:
            table[:, dim] = sign * DOWNLOAD_BOUND  # ... + b_i
        for rating in (meta.scale.low, meta.scale.high):
            values = _server_view(cfg, meta, rating, 2, f"extreme {sign} {rating}", weights, table)
            assert np.isfinite(values).all() and np.all(np.abs(values) <= delta * (1 + 1e-6)), values
            assert np.all(np.abs(values) >= delta * (1 - 1e-6))  # saturated: the server did reach the clip
    for k in ("-8", "-1e-3"):  # -n would make n / (n + k) infinite, -n < k < 0 larger than 1
        with pytest.raises(ConfigError, match="personal_shrink"):
            from_run_config({"preset": "fedgnn_tuned", "dataset": "synthetic",
                             "set": f"model.population_bias=true model.personal_shrink={k}"})


def test_a_download_within_the_bound_cannot_mark_the_users_who_rated_an_item_with_nan(tiny_cfg):
    """The server wants to know who rated item j. It sends j's row at +DOWNLOAD_BOUND and the model's weights scaled
    up to the bound (all values a device accepts, `check_download`). Only a user who rated j puts j's row through
    its GNN (pseudo rows never enter the step), so only its step can overflow. LDP noise hides any finite value, but
    no noise hides NaN: every upload must be finite (or non-finite alike) whether the user rated j or not.
    Before the fix, 832 of the rated-j user's model-gradient coordinates were NaN and none of the other's. The rater's
    private state must survive the overflow, and its evaluation under the same download must report finite sums."""
    cfg = tiny_cfg(*B_POP)
    meta = UserPartitions(prepare_partitions(cfg.data)).meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    weights = [np.array(np.clip(w * DOWNLOAD_BOUND, -DOWNLOAD_BOUND, DOWNLOAD_BOUND), np.float32)
               for w in server.model_weights()]
    others = np.array([10, 12, 14])

    def registered(items: np.ndarray, label: str) -> tuple[FedGNNClient, np.ndarray]:
        client = FedGNNClient(cfg, meta, [3], lambda u: _rated(u, 4.0, items), MemoryStore(), secret=_secret(label))
        reg, _, _ = client.fit([], {"phase": PHASE_REGISTER, "round": 1})
        (_, fields), = split_users(reg, REGISTER_FIELDS)
        return client, np.sort(fields[0])

    non_rater, non_rater_set = registered(np.array([6, 10, 12, 14]), "nan non-rater")
    j = int(np.setdiff1d(non_rater_set, [6, *others])[0])  # a pseudo item of the non-rater: is it real or not?
    rater, rater_set = registered(np.sort(np.array([j, *others])), "nan rater")
    table = server.table()
    table[j] = DOWNLOAD_BOUND
    nonfinite = {}
    for rated_j, client, ids in ((True, rater, rater_set), (False, non_rater, non_rater_set)):
        assert j in ids  # the server sends j's row to both users: both have it in their anonymity sets
        upload, _, _ = client.fit(frame_download(weights, [3], [table[ids]]), {"phase": PHASE_TRAIN, "round": 2})
        (_, (flat, _, rows)), = split_users(upload, TRAIN_FIELDS)
        nonfinite[rated_j] = int((~np.isfinite(flat)).sum() + (~np.isfinite(rows)).sum())
    assert nonfinite[True] == nonfinite[False] == 0, nonfinite
    kept = rater._user(3)
    assert np.isfinite(kept.state.embedding).all() and np.isfinite(kept.state.offset)
    # weights only 10x: the rater's step stays finite but its embedding would land near 1e20, which the device would
    # then send to the neighbour service and carry into every later step; it keeps its state within the bound instead
    tenfold = [np.array(np.clip(w * 10, -DOWNLOAD_BOUND, DOWNLOAD_BOUND), np.float32) for w in server.model_weights()]
    rater.fit(frame_download(tenfold, [3], [table[rater_set]]), {"phase": PHASE_TRAIN, "round": 3})
    assert np.abs(rater._user(3).state.embedding).max() <= DOWNLOAD_BOUND
    train = np.sort(np.array([j, *others]))
    with_test = UserData(3, train, np.full(train.size, 4.0, np.float32), np.array([j, *others]),
                         np.full(4, 4.0, np.float32))
    sums = FedGNNUser(rater.device_cfg, meta, with_test, rater.store).evaluate(weights, table[rater_set])
    assert sums.n == 4 and np.isfinite(sums.sse) and np.isfinite(sums.sae), sums


@pytest.mark.parametrize("share", [0.0, 0.3])
def test_under_user_dp_b_pop_is_clipped_with_the_rest_of_the_update(tmp_path, share):
    """The server isolates b_pop: it downloads a model whose only non-zero weights are the global bias and b_pop (both
    at the midpoint) and an all-zero table, so the full prediction is the user's own mean (user_offset_reg = 0) and,
    with the items' terms off the population loss (population_item_weight = 0), every gradient but b_pop's is 0.
    Unclipped, the user's whole update is its b_pop pull, past C. Clipped (what the node adds, before its noise
    share), the update's L2 norm, b_pop included, is at most C = 1: inside the joint clip (privacy.population_clip =
    0) b_pop is scaled by the same factor as everything else; on its own bound (0.3, the preset) it is the pull
    weighted by the user's 8 of 20 ratings and scaled by 0.3 C / (2 span), never past 0.3 C. Either way the b_pop
    coordinate of the sum moves by at most C between neighbours."""
    def world(clip: str):
        cfg = load_config("fedgnn_user_dp", "synthetic", [
            f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "data.synthetic.num_users=60",
            "data.synthetic.num_items=80", "data.synthetic.mean_degree=12", "model.dim=16",
            f"simulation.device_secrets={fixed_secrets(tmp_path)}", "simulation.users_per_node=1",
            "model.user_offset_reg=0", f"privacy.clip_norm={clip}", f"privacy.population_clip={share}",
            "privacy.population_ratings=20",
            "model.population_item_weight=0"])  # the items' terms off the population loss: b_pop's is the only one
        return cfg, UserPartitions(prepare_partitions(cfg.data)).meta

    def update(cfg, meta, rating: float) -> tuple[list[np.ndarray], int]:
        server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
        names = [name for name, _ in server.model.named_parameters()]
        weights = [np.zeros_like(w) for w in server.model_weights()]
        weights[names.index("bias")][...] = meta.scale.midpoint
        weights[names.index("population_bias")][...] = meta.scale.midpoint
        user = FedGNNUser(DeviceSections.from_config(cfg, _secret(f"user_dp {rating}")), meta, _rated(3, rating),
                          MemoryStore())
        vector = node_update([user], weights, np.zeros_like(server.table()), 2, None, 8, 1.0, 0.0)  # q = 1, no noise
        return vector, names.index("population_bias")

    def norm(vector: list[np.ndarray]) -> float:
        return float(np.sqrt(sum(np.square(a, dtype=np.float64).sum() for a in vector)))

    cap = 4.0  # the pull: twice the mean residual from the midpoint 3 to a rating of 1 or 5 (a user's weight is <= 1)
    own = ITEMS.size / 20 * share / (2 * 4.0)  # the split's scale of the pull per unit of C: 8 of 20 ratings, / 2 span
    cfg, meta = world("1e6")  # no clip: what the user's update is
    for rating, sign in ((meta.scale.low, 1.0), (meta.scale.high, -1.0)):
        vector, at = update(cfg, meta, rating)
        pull = sign * float(vector[at][0]) / (own * 1e6 if share else 1.0)
        assert 2.0 < pull <= cap * (1 + 1e-6)  # past C = 1 on its own
        assert norm(vector) == pytest.approx(abs(float(vector[at][0])), rel=1e-5)  # b_pop is the whole update

    cfg, meta = world("1")
    clip = cfg.privacy.clip_norm
    clipped = {}
    for rating, sign in ((meta.scale.low, 1.0), (meta.scale.high, -1.0)):
        vector, at = update(cfg, meta, rating)
        assert norm(vector) <= clip * (1 + 1e-5)
        if share:  # weighted and scaled, never clipped
            assert float(vector[at][0]) == pytest.approx(sign * cap * own * clip, rel=1e-4)
        else:
            assert float(vector[at][0]) == pytest.approx(sign * clip, rel=1e-5)  # scaled to C, not dropped nor kept
        clipped[rating] = vector
    gap = [a - b for a, b in zip(clipped[meta.scale.low], clipped[meta.scale.high])]
    assert norm(gap) <= 2 * clip * (1 + 1e-5)  # replace-one: 2C; add or remove one user: each vector's C


def test_a_prediction_that_overflowed_is_scored_as_the_scales_midpoint():
    """What a device reports of its test ratings is finite whatever its model computed: a NaN prediction (a download
    within the bounds can overflow the model of the users who rated a chosen item) is scored as the scale's midpoint,
    +-inf as the scale's ends, so the error sums never say which ratings made the model overflow."""
    sums = squared_error_sum(np.array([np.nan, np.inf, -np.inf, 4.0]), np.array([5.0, 5.0, 1.0, 4.0]), 1.0, 5.0)
    assert sums == (4.0, 2.0, 4)
