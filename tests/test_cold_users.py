"""Cold and light users: what a user with no training rating, or a few, is given to predict with.

A cold user (no rating, no neighbour) predicts the model's population part: the population bias b_pop
(model.population_bias, trained on the population loss) plus the items' own terms; a user with n ratings adds its
own part weighted n / (n + k) (model.personal_shrink). Both are on the device and cost no privacy.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import ConfigError, load_config
from fedrec_flwr.data import load_from_config
from fedrec_flwr.fedgnn.state import UserState
from fedrec_flwr.fedgnn.user import evaluate_user
from fedrec_flwr.models.rating_gnn import build_model, row_width
from fedrec_flwr.reference.baselines import baseline_rmses
from tests.conftest import fixed_secrets

SPARSE = ["data.synthetic.num_users=300", "data.train_per_user=3.5", "data.cold_fraction=0.2"]


def _cfg(tmp_path, preset: str, *overrides: str):
    return load_config(preset, "synthetic", [
        f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}",
        f"simulation.device_secrets={fixed_secrets(tmp_path)}", *SPARSE, *overrides])


# each mode at a short schedule: user-level DP (its preset: b_pop, offsets, the own part shrunk) and the paper's
# LDP on fedgnn_tuned's model with the same three device-side switches
MODES = {
    "user_dp": ("fedgnn_user_dp", ["federation.rounds=40", "federation.eval_every=40",
                                   "federation.clients_per_round=150"]),
    "ldp": ("fedgnn_tuned", ["federation.rounds=40", "federation.eval_every=40", "federation.clients_per_round=60",
                             "model.dim=16", "model.population_bias=true", "server_opt.population_lr=0.05",
                             "model.personal_shrink=5"]),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_cold_user_scores_no_worse_than_the_global_mean(tmp_path, mode):
    """On a sparse synthetic split whose mean (3.47) is half a star from the scale's midpoint, where a model's
    global bias starts, the cold users' test ratings are predicted at least as well as the training mean predicts
    them (within 1%), in both privacy modes. A population part left at the midpoint fails this by far."""
    preset, overrides = MODES[mode]
    cfg = _cfg(tmp_path, preset, *overrides)
    ds = load_from_config(cfg.data)
    per_user = np.bincount(ds.train.users, minlength=ds.num_users)
    cold = np.flatnonzero(per_user == 0)
    assert np.isin(ds.test.users, cold).sum() > 50  # enough cold test ratings to tell
    groups = run_in_process(cfg, log_every=0, by_group=True)["by_user_group"]
    global_mean = baseline_rmses(ds, cold)["global_mean"]
    assert groups["cold"]["test_ratings"] == np.isin(ds.test.users, cold).sum()
    assert groups["cold"]["rmse"] <= global_mean * 1.01, (groups["cold"]["rmse"], global_mean)


def _cold_user_case(tmp_path):
    cfg = _cfg(tmp_path, "fedgnn_user_dp", "model.personal_shrink=5")
    model = build_model(cfg.model, 3.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # away from the zeros the maps start at
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((100, row_width(cfg.model))).astype(np.float32)
    items = np.array([3, 17, 42, 77])
    data = dataclasses.make_dataclass("D", ["user", "train_items", "train_values", "test_items", "test_values",
                                            "item_features"])(0, np.zeros(0, np.int64), np.zeros(0, np.float32),
                                                              items, np.array([4, 2, 5, 3], np.float32), None)
    return model, rows, data


def test_a_cold_user_predicts_the_population_part_whatever_its_drawn_embedding(tmp_path):
    """A cold user without neighbours has no taste of its own: its score is b_pop plus the items' own terms, and an
    embedding drawn 100 times larger changes nothing (the full model would multiply its dot products by 100)."""
    model, rows, data = _cold_user_case(tmp_path)
    scores = []
    for scale in (0.1, 10.0):
        state = UserState(np.full(model.dim, scale, np.float32), np.arange(100), np.zeros((0, model.dim), np.float32),
                          "h", 0.0)
        scores.append(evaluate_user(model, state, data, rows, 1.0, 5.0, whole_table=True))
    assert scores[0] == scores[1]
    x = torch.from_numpy(rows[data.test_items])
    want = (model.population_bias + x[:, -1] + x[:, :-1] @ model.item_bias_map).detach().numpy().clip(1, 5)
    assert scores[0].sse == pytest.approx(float(((want - data.test_values) ** 2).sum()), rel=1e-5)


def test_a_user_s_own_part_counts_by_its_ratings(tmp_path):
    """With model.personal_shrink = k, a user with n ratings predicts the population part plus n / (n + k) of the
    rest of its full prediction (dot product, user bias, offset): one rating keeps a sixth of what its embedding
    says at k = 5, forty nearly all, and k = 0 is the full model."""
    model, rows, data = _cold_user_case(tmp_path)
    data = dataclasses.replace(data, test_items=data.test_items[:1], test_values=np.array([-1000.0], np.float32))
    state = UserState(np.full(model.dim, 2.0, np.float32), np.arange(100), np.zeros((0, model.dim), np.float32), "h",
                      0.4)

    def predicted(n: int, k: float) -> float:  # one test rating far below: the error is the prediction + 1000
        d = dataclasses.replace(data, train_items=np.arange(50, 50 + n), train_values=np.full(n, 3.0, np.float32))
        return float(np.sqrt(evaluate_user(model, state, d, rows, -1e9, 1e9, whole_table=True,
                                           personal_shrink=k).sse)) - 1000.0

    population = predicted(0, 5.0)  # cold and alone
    for n in (1, 4, 40):
        full = predicted(n, 0.0)
        assert abs(full - population) > 0.05  # the user's own part says something
        assert predicted(n, 5.0) == pytest.approx(population + n / (n + 5) * (full - population), abs=1e-3)


def test_an_offset_shrinkage_without_an_offset_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.user_offset_reg"):
        _cfg(tmp_path, "fedgnn_tuned", "model.user_offset_reg=5")


@pytest.mark.parametrize("key", ["model.personal_shrink=5", "server_opt.population_lr=0.05"])
def test_a_population_switch_without_b_pop_is_refused(tmp_path, key):
    """The own part's weight and b_pop's rate mean nothing without b_pop: the full model's b, which the users' free
    terms leave near the midpoint, would stand in for the population part."""
    without = ("model.population_bias=false", "model.personal_shrink=0", "server_opt.population_lr=0")
    with pytest.raises(ConfigError, match=key.split("=")[0]):
        _cfg(tmp_path, "fedgnn_tuned", *without, key)


def test_the_population_item_weight_needs_the_items_own_terms(tmp_path):
    """model.population_item_weight trains the items' own terms (w.x_i, b_i); a model without either has none."""
    with pytest.raises(ConfigError, match="model.population_item_weight"):
        _cfg(tmp_path, "fedgnn_user_dp", "model.biases=false", "model.item_bias=false",
             "model.population_item_weight=1")


@pytest.mark.parametrize("preset", ["fedgnn_tuned", "fedgnn_paper"])
def test_the_population_item_weight_is_refused_under_the_papers_ldp(tmp_path, preset):
    """Under the paper's LDP the population loss would add a direction to the real rows that the pseudo rows fitted to
    them do not imitate, so a server could tell them apart better: the config refuses it, and a device loads the run
    config it is sent through the same check, whatever the server asks."""
    from fedrec_flwr.config import from_run_config

    with pytest.raises(ConfigError, match="model.population_item_weight"):
        _cfg(tmp_path, preset, "model.population_bias=true", "model.population_item_weight=1")
    with pytest.raises(ConfigError, match="model.population_item_weight"):
        from_run_config({"preset": preset, "dataset": "synthetic", "data-dir": str(tmp_path), "seed": 0,
                         "set": "model.population_bias=true model.population_item_weight=1"})


def _local_steps(tmp_path, weight: float):
    """Six synthetic users' local step under fedgnn_user_dp's model with model.population_item_weight = `weight`:
    one step on all of each user's ratings, the same dropout draws and downloads whatever the weight."""
    from fedrec_flwr.data import UserPartitions, prepare_partitions
    from fedrec_flwr.fedgnn.local_step import local_steps
    from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore

    cfg = _cfg(tmp_path, "fedgnn_user_dp", "model.dim=8", "local.steps=1", "model.dropout=0.3",
               f"model.population_item_weight={weight}")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    torch.manual_seed(0)
    model = build_model(cfg.model, meta.scale.midpoint)
    with torch.no_grad():
        model.item_bias_map.add_(torch.randn_like(model.item_bias_map) * 0.3)  # t_i = w.x_i + b_i, both parts live
    users = [FedGNNUser(DeviceSections.from_config(cfg), meta, parts.user(u), MemoryStore(), None, model)
             for u in range(300) if parts.user(u).train_items.size >= 3][:6]
    table = np.random.default_rng(1).standard_normal((meta.num_items, row_width(cfg.model))).astype(np.float32)
    step = local_steps(users[0].cfg, model, [u.state for u in users], [u.data for u in users], [table] * len(users),
                       [np.random.default_rng(k) for k in range(len(users))],
                       [torch.Generator().manual_seed(k) for k in range(len(users))], torch.device("cpu"))
    return model, users, table, step


def test_the_population_loss_on_the_items_terms_moves_their_rows_and_nothing_private(tmp_path):
    """With model.population_item_weight = lambda each rated item's b_i gradient gains lambda times the population
    loss's, 2 (b_pop + t_i - r), so the items' own terms learn what a user of whom nothing is known is given; with
    gradient uploads (the presets') the private embedding and offset, and b_pop's own pull, are the full loss's as
    before."""
    lam = 0.5
    model, users, table, without = _local_steps(tmp_path, 0.0)
    _, _, _, with_items = _local_steps(tmp_path, lam)
    np.testing.assert_array_equal(with_items.embeddings, without.embeddings)
    np.testing.assert_array_equal(with_items.offsets, without.offsets)
    names = [name for name, _ in model.named_parameters()]
    at = names.index("population_bias")
    torch.testing.assert_close(with_items.model_grads[at], without.model_grads[at], rtol=0, atol=0)
    w = model.item_bias_map.detach().numpy()
    for k, u in enumerate(users):
        n = u.data.train_items.size
        rows = table[u.data.train_items]
        residual = float(model.population_bias.detach()) + rows[:, :-1] @ w + rows[:, -1] - u.data.train_values
        moved = (with_items.rows[k, :n, -1] - without.rows[k, :n, -1]).numpy()
        # the summed loss: each rating's gradient at weight 1 / n, times the pick's size n
        np.testing.assert_allclose(moved, lam * 2 * residual, rtol=1e-4, atol=1e-5)
    assert not torch.equal(with_items.model_grads[names.index("item_bias_map")],
                           without.model_grads[names.index("item_bias_map")])
