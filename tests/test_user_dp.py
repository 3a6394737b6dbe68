"""User-level DP for FedGNN (privacy.mode = user_dp): the accounting, the device's clip and noise, the server's view,
and a short run in-process and through `flwr run` with SecAgg+."""

from __future__ import annotations

import json

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from fedrec_flwr.audit.attacks import separation_auc
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import ConfigError, load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.accounting import (
    UserDPAccountant,
    calibrate_noise_multiplier,
    released_evaluations,
    sample_rate,
)
from fedrec_flwr.fedgnn.device_policy import floor_nodes, share_std
from fedrec_flwr.fedgnn.local_step import StepBatch
from fedrec_flwr.fedgnn.protocol import REGISTER_FIELDS, UploadRejected, split_users
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore
from fedrec_flwr.fedgnn.user_dp import (
    NodeSum,
    PopulationPull,
    check_sum,
    node_update,
    samples_itself,
    update_norms,
)
from fedrec_flwr.models.rating_gnn import build_model
from tests.conftest import fixed_secrets
from tests.test_e2e_flwr import needs_superlink, run_main

# a tiny federation (60 users, ~2 test ratings each) can release an evaluation only with small weights' noise
SMALL_EVAL = ("privacy.eval_max_ratings=2", "privacy.eval_noise_multiplier=3")
# A run whose only evaluation must be released: 40 synthetic users hold a released count of 5.8 (23 users with test
# ratings, at most 2 counted each, over sqrt 3), which noise 3 makes non-positive in 2.7% of runs (the run then has no
# result); noise 1 in 4e-9
SURE_EVAL = ("privacy.eval_max_ratings=2", "privacy.eval_noise_multiplier=1")


def _direct_epsilon(q: float, sigma: float, rounds: int, delta: float, evaluations: int = 0,
                    eval_sigma: float = 3.0) -> float:
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds))
    if evaluations:
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(eval_sigma), evaluations))
    return acc.get_epsilon(delta)


def test_calibration_leaves_room_for_the_released_evaluations_and_charges_them():
    """sigma is calibrated so that the training rounds and the evaluations they release (after every eval_every-th
    round and the last) spend the target together; each evaluation is charged as a Gaussian every user is in."""
    q, rounds = 512 / 943, 100
    alone = calibrate_noise_multiplier(q, rounds, 8.0, 1e-5)
    sigma = calibrate_noise_multiplier(q, rounds, 8.0, 1e-5, released_evaluations(rounds, 100), 4.0)
    assert released_evaluations(rounds, 100) == 1 and released_evaluations(rounds, 20) == 5
    assert sigma > alone  # the evaluation's share of the budget costs training noise
    assert _direct_epsilon(q, sigma, rounds, 1e-5, 1, 4.0) <= 8.0 < _direct_epsilon(q, sigma * 0.99, rounds, 1e-5,
                                                                                    1, 4.0)
    acc = UserDPAccountant(943, q, sigma, 1.0, 1e-5, 8.0, 4.0, 100)
    for _ in range(rounds):
        acc.record_round(sigma)
    acc.record_evaluation(4.0)
    assert acc.epsilon() == pytest.approx(_direct_epsilon(q, sigma, rounds, 1e-5, 1, 4.0), rel=1e-6)
    with pytest.raises(ValueError, match="alone spend"):
        calibrate_noise_multiplier(q, rounds, 1.0, 1e-5, 5, 1.0)


def test_calibrated_noise_spends_the_target_over_the_planned_rounds_and_no_more():
    q, rounds = 128 / 943, 300
    sigma = calibrate_noise_multiplier(q, rounds, 8.0, 1e-5)
    assert _direct_epsilon(q, sigma, rounds, 1e-5) <= 8.0 < _direct_epsilon(q, sigma * 0.99, rounds, 1e-5)
    acc = UserDPAccountant(943, q, sigma, 1.0, 1e-5, 8.0)
    for _ in range(rounds):
        acc.record_round(sigma)
    assert acc.epsilon() == pytest.approx(_direct_epsilon(q, sigma, rounds, 1e-5), rel=1e-9)
    assert acc.budget()["epsilon_at_1_over_n"]["epsilon"] < acc.epsilon()  # 1/N > 1e-5 here: a looser delta


def test_a_run_stops_before_it_would_exceed_its_budget(tiny_cfg):
    """Given noise and a target, the schedule keeps only the rounds the budget allows; fewer reporting users mean
    less noise, which the ledger charges."""
    q, sigma = sample_rate(20, 60), 2.0
    low, high = 0, 200  # the last round count within 4.0 by dp-accounting directly (epsilon grows with rounds)
    while low < high:  # with the one evaluation the run releases at its end (eval_every = 1000)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if _direct_epsilon(q, sigma, mid, 1e-5, 1) <= 4.0 else (low, mid - 1)
    allowed = low
    acc = UserDPAccountant(60, q, sigma, 1.0, 1e-5, 4.0, 3.0, 1000)
    assert 1 < allowed < 200 and acc.affordable_rounds(200) == allowed
    assert acc.affordable_rounds(allowed - 1) == allowed - 1
    full, half = UserDPAccountant(60, q, sigma, 1.0, 1e-5), UserDPAccountant(60, q, sigma, 1.0, 1e-5)
    full.record_round(sigma)
    half.record_round(sigma * np.sqrt(30 / 60))
    assert half.epsilon() > full.epsilon()

    cfg = tiny_cfg("privacy.mode=user_dp", f"privacy.noise_multiplier={sigma}", "privacy.target_epsilon=4.0",
                   f"federation.rounds={allowed + 5}", "federation.eval_every=1000", "federation.clients_per_round=20",
                   *SMALL_EVAL)
    out = run_in_process(cfg, log_every=0)
    trained = [h for h in out["history"] if "phase" not in h]
    assert len(trained) == allowed and out["history"][-1]["privacy"]["stopped_by_budget"]
    assert out["history"][-1]["privacy"]["epsilon"] <= 4.0 and out["history"][-1]["privacy"]["evaluations"] == 1


def test_user_dp_refuses_what_its_guarantee_does_not_cover():
    for extra, words in ((["expansion.mode=fixed"], "neighbour service"), (["merge.robust=median"], "only the sum"),
                         (["privacy.target_epsilon=0"], "no noise"), (["local.upload=delta"], "delta")):
        with pytest.raises(ConfigError, match=words):
            load_config("fedgnn_user_dp", "synthetic", extra)


def _steps(grads: list[np.ndarray], rows: list[np.ndarray]) -> StepBatch:
    width = max(r.shape[0] for r in rows)
    padded = np.zeros((len(rows), width, rows[0].shape[1]), np.float32)
    for k, r in enumerate(rows):
        padded[k, : r.shape[0]] = r
        padded[k, r.shape[0]:] = 99.0  # padding must not count
    return StepBatch([torch.from_numpy(np.stack(grads))], torch.from_numpy(padded), [r.shape[0] for r in rows],
                     np.zeros((len(rows), 2)), np.zeros(len(rows)), np.zeros(len(rows)))


def test_each_users_whole_update_is_clipped_to_c_and_lands_on_its_own_items_only():
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=5).astype(np.float32) * s for s in (10.0, 0.01)]
    rows = [rng.normal(size=(3, 4)).astype(np.float32) * 10, rng.normal(size=(1, 4)).astype(np.float32) * 0.01]
    items = [np.array([1, 4, 7]), np.array([2])]
    steps = _steps(grads, rows)
    norms = update_norms(steps).numpy()
    expected = [np.sqrt(np.square(g).sum() + np.square(r).sum()) for g, r in zip(grads, rows)]
    np.testing.assert_allclose(norms, expected, rtol=1e-6)
    node = NodeSum([(5,)], 10, 4, 1.0, torch.device("cpu"))
    node.add(steps, items)
    model, table = node.noised(0.0, np.random.default_rng(0))
    big = 1.0 / expected[0]  # the large update is scaled to norm exactly C, the small one passes unchanged
    np.testing.assert_allclose(model, grads[0] * big + grads[1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(table[[1, 4, 7]], rows[0] * big, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(table[2], rows[1][0], rtol=1e-5)
    assert not table[[0, 3, 5, 6, 8, 9]].any()  # rows nobody rated stay zero before the noise
    clipped = np.sqrt(np.square(grads[0] * big).sum() + np.square(rows[0] * big).sum())
    assert clipped == pytest.approx(1.0, rel=1e-5)


def _pull_steps(pulls: list[float], rest: list[np.ndarray], counts: list[int]) -> StepBatch:
    """Steps of users whose model is [b_pop, w (3 coordinates)] and who rated `counts` items (one-wide rows)."""
    rows = np.zeros((len(counts), max(counts), 1), np.float32)
    for k, n in enumerate(counts):
        rows[k, :n, 0] = 0.5
    return StepBatch([torch.tensor(pulls, dtype=torch.float32), torch.from_numpy(np.stack(rest).astype(np.float32))],
                     torch.from_numpy(rows), counts, np.zeros((len(counts), 2)), np.zeros(len(counts)),
                     np.zeros(len(counts)))


@pytest.mark.parametrize("share,ratings", [(0.3, 20), (0.99, 1), (0.01, 1000)])
def test_the_population_pull_bounded_on_its_own_keeps_each_users_whole_update_within_c(share, ratings):
    """Per-part clipping: b_pop's pull gets share C, the rest C sqrt(1 - share^2), so no user, however large or
    hostile its step (a pull of 1e6, a model gradient of 1e6), adds more than C to the sum, whatever share and
    cap the run config (the server) asks: the sensitivity the accounting assumes. A pull that is not finite drops
    the whole user, as a non-finite update does."""
    pop = PopulationPull(index=0, share=share, ratings=ratings, span=4.0)
    rng = np.random.default_rng(1)
    cases = [(1e6, rng.normal(size=3) * 1e6, 50), (-1e6, rng.normal(size=3) * 1e-3, 1), (8.0, np.zeros(3), 20),
             (0.0, rng.normal(size=3) * 10, 3), (float("nan"), rng.normal(size=3), 5),
             (float("inf"), rng.normal(size=3), 5), (-float("inf"), rng.normal(size=3), 5)]
    for pull, rest, n in cases:
        node = NodeSum([(1,), (3,)], 60, 1, 1.0, torch.device("cpu"), pop)
        node.add(_pull_steps([pull], [rest], [n]), [np.arange(n)])
        b, w, table = node.noised(0.0, np.random.default_rng(0))
        norm = float(np.sqrt(np.square(b).sum() + np.square(w).sum() + np.square(table).sum()))
        assert norm <= 1.0 + 1e-5, (pull, n, norm)
        if not np.isfinite(pull):
            assert norm == 0.0  # the whole user dropped
        else:  # the pull's part never past share C, and the rest within what remains
            assert abs(float(b[0])) <= share + 1e-6
            assert float(np.sqrt(np.square(w).sum() + np.square(table).sum())) <= np.sqrt(1 - share**2) + 1e-5


def test_the_population_pull_follows_the_ratings_mean_where_the_joint_clip_follows_the_users():
    """Light users rating above b_pop (residual -1 each: 30 users of 1 rating) and heavy users rating below it
    (residual +1: 10 users of 20 ratings, their model gradients large as a summed loss makes them). The ratings'
    mean residual is (200 - 30) / 230 > 0, so b_pop must go down: the pull weighted by ratings says so. Inside the
    joint clip the heavy users' pulls shrink with their clip factors and the sum points the other way, which is
    what left b_pop at the users' mean on ML-100K's sparse variants."""
    counts = [1] * 30 + [20] * 10
    pulls = [-2.0] * 30 + [2.0] * 10  # twice the mean residual, as `population_bias_gradient` gives
    rest = [np.full(3, 0.1)] * 30 + [np.full(3, 20.0)] * 10
    items = [np.arange(n) for n in counts]
    joint = NodeSum([(1,), (3,)], 60, 1, 1.0, torch.device("cpu"))
    joint.add(_pull_steps(pulls, rest, counts), items)
    assert float(joint.noised(0.0, np.random.default_rng(0))[0][0]) < 0  # the light users win
    split = NodeSum([(1,), (3,)], 60, 1, 1.0, torch.device("cpu"), PopulationPull(0, 0.3, 20, 4.0))
    split.add(_pull_steps(pulls, rest, counts), items)
    got = float(split.noised(0.0, np.random.default_rng(0))[0][0])
    # each pull weighted min(n, 20) / 20 and scaled by 0.3 / (2 * 4): 10 * 2 - 30 * 2 / 20 = 17, times 0.0375
    assert got == pytest.approx((10 * 2.0 - 30 * 2.0 / 20) * 0.3 / 8.0, rel=1e-5)


def test_a_cover_step_adds_no_population_pull():
    """A user whose coin said no (a deployed device computes the step as cover) adds nothing, b_pop's pull included."""
    node = NodeSum([(1,), (3,)], 60, 1, 1.0, torch.device("cpu"), PopulationPull(0, 0.3, 20, 4.0))
    node.add(_pull_steps([4.0, -4.0], [np.ones(3), np.ones(3)], [20, 5]), [np.arange(20), np.arange(5)],
             include=[False, False])
    assert not any(a.any() for a in node.noised(0.0, np.random.default_rng(0)))


def test_the_preset_bounds_b_pops_own_coordinate_and_the_rest_of_a_real_update(tmp_path):
    """On the preset's model (`population_pull` finds b_pop among the weights): a download with b_pop at the bound
    and the item table at the bound still gives each user b_pop's coordinate within 0.3 C and the rest within
    C sqrt(1 - 0.09), the whole within C."""
    cfg = load_config("fedgnn_user_dp", "synthetic", [
        f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", "data.synthetic.num_users=60",
        "data.synthetic.num_items=80", "data.synthetic.mean_degree=12", "model.dim=16", "simulation.users_per_node=1",
        f"simulation.device_secrets={fixed_secrets(tmp_path)}"])
    assert cfg.privacy.population_clip == 0.3
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    at = [name for name, _ in server.model.named_parameters()].index("population_bias")
    for b_pop, rows in ((None, None), (1e6, 1e6), (-1e6, 0.0)):
        weights, table = server.model_weights(), server.table()
        if b_pop is not None:
            weights[at][...] = b_pop
            table[...] = rows
        for u in (0, 1, 2):
            user = FedGNNUser(DeviceSections.from_config(cfg), meta, parts.user(u), MemoryStore())
            vector = node_update([user], weights, table, 2, None, 8, 1.0, 0.0)
            whole = float(np.sqrt(sum(np.square(a, dtype=np.float64).sum() for a in vector)))
            own = abs(float(vector[at].reshape(-1)[0]))
            assert whole <= 1.0 + 1e-5 and own <= 0.3 + 1e-6
            assert np.sqrt(max(whole**2 - own**2, 0.0)) <= np.sqrt(1 - 0.09) + 1e-5
            if b_pop:  # a pull at the bound: the clamp's full share
                assert own == pytest.approx(0.3, rel=1e-5)


def test_the_population_clip_needs_the_population_bias():
    with pytest.raises(ConfigError, match="privacy.population_clip"):
        load_config("fedgnn_user_dp", "synthetic", ["model.population_bias=false", "model.personal_shrink=0",
                                                     "server_opt.population_lr=0", "privacy.population_clip=0.3"])
    with pytest.raises(ConfigError, match="privacy.population_clip"):
        load_config("fedgnn_user_dp", "synthetic", ["privacy.population_clip=1"])


def test_the_servers_view_the_noisy_sum_holds_no_row_of_any_user(tiny_cfg):
    """Each node's vector covers the whole table. Ranking rows by magnitude finds a one-user node's rated items at
    once without noise (its unrated rows are exactly zero), and still above chance with noise, since one node
    carries only its share (1/N of the variance): that is why SecAgg+ masks it. What the server gets is the
    sum of all nodes' vectors, with the whole noise: there the same attack is at chance for every user."""
    def vectors(sigma: float) -> tuple[list[np.ndarray], object]:
        cfg = tiny_cfg("privacy.mode=user_dp", f"privacy.noise_multiplier={sigma}", "federation.clients_per_round=60")
        parts = UserPartitions(prepare_partitions(cfg.data))
        meta = parts.meta
        device_cfg = DeviceSections.from_config(cfg)
        model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
        server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
        floor = floor_nodes(cfg.privacy.min_node_fraction, meta.num_users)  # one user per node
        out = []
        for u in range(meta.num_users):
            user = FedGNNUser(device_cfg, meta, parts.user(u), MemoryStore(), model=model)
            assert user.register().size == 0  # no anonymity set is ever sent
            assert samples_itself(device_cfg.secret, u, 2, 1.0)  # q = 60 / 60: every user takes part
            out.append(node_update([user], server.model_weights(), server.table(), 2, None, 8, 1.0,
                                   share_std(sigma, 1.0, floor))[-1])
        return out, parts

    def mean_auc(tables: list[np.ndarray], parts) -> float:
        aucs = []
        for u, rows in enumerate(tables):
            rated = np.isin(np.arange(rows.shape[0]), parts.user(u).train_items)
            if rated.any() and not rated.all():
                aucs.append(separation_auc(np.abs(rows).sum(1), rated))
        return float(np.mean(aucs))

    clear, parts = vectors(1e-6)
    assert mean_auc(clear, parts) > 0.99
    noisy, parts = vectors(1.0)
    assert noisy[0].shape == (parts.meta.num_items, clear[0].shape[1])
    floor = floor_nodes(0.8, parts.meta.num_users)
    share = np.sqrt(1 / floor)  # sigma C / sqrt(K) per node: the noise floor K = 48 of the 60 one-user nodes
    assert np.std(np.concatenate([t.ravel() for t in noisy])) == pytest.approx(share, rel=0.05)
    assert mean_auc(noisy, parts) > 0.55  # one unmasked node would leak: SecAgg+ hides it
    # the server's view: the sum. Against the same sum without user u (its neighbour in the DP relation) the
    # attack must do no better: what remains is the population's popularity, which DP lets anyone learn
    for tables, gap in ((clear, "large"), (noisy, "none")):
        total = np.sum(tables, axis=0)
        with_u = mean_auc([total] * len(tables), parts)
        without_u = mean_auc([total - c for c in clear], parts)
        if gap == "large":
            assert with_u - without_u > 0.05
        else:
            # the whole noise: sigma C sqrt(N / K) with every node reporting, at least sigma C
            assert np.std(total) == pytest.approx(np.sqrt(parts.meta.num_users / floor), rel=0.05)
            assert abs(with_u - without_u) < 0.02


def test_the_server_refuses_an_aggregate_no_honest_round_can_give():
    shapes, table = [(3,), ()], (5, 2)
    ok = [np.zeros(3), np.zeros(1), np.zeros((5, 2))]
    assert [a.shape for a in check_sum(ok, shapes, table, 1.0, 0.1, 10.0)] == [(3,), (), (5, 2)]
    with pytest.raises(UploadRejected, match="arrays"):
        check_sum(ok[:2], shapes, table, 1.0, 0.1, 10.0)
    with pytest.raises(UploadRejected, match="NaN"):
        check_sum([np.full(3, np.nan), np.zeros(1), np.zeros((5, 2))], shapes, table, 1.0, 0.1, 10.0)
    with pytest.raises(UploadRejected, match="L2 norm"):  # ~30 clipped updates of C = 1 cannot sum to 1000
        check_sum([np.full(3, 1000.0), np.zeros(1), np.zeros((5, 2))], shapes, table, 1.0, 0.1, 10.0)


def _honest_sum(rng, d: int, users: int, std: float, aligned: bool) -> np.ndarray:
    """users clipped updates of norm C = 1 (all in one direction when aligned: the largest honest signal) + N(0,
    std^2)."""
    signal = np.zeros(d)
    if aligned:
        signal[:] = users / np.sqrt(d)
    else:
        for _ in range(users):
            u = rng.standard_normal(d)
            signal += u / np.linalg.norm(u)
    return signal + std * rng.standard_normal(d)


def test_the_sum_check_passes_honest_rounds_and_bounds_one_devices_addition_to_what_honest_users_reach():
    """The server's two-sided check on a user-DP sum (ML-100K's size: d = 60,000, ~650 users at most, noise 1.1 a
    coordinate). Honest sums pass, whether the users' updates are spread or all aligned (the largest honest signal).
    A sum that other nodes' forged SecAgg+ weights shrank by 10% is refused: the noise's norm concentrates.
    One device adding a vector the earlier linear bound let through ((U C + s (sqrt d + 6)): 880 long) is refused;
    what it can still add is at most about U C (`benchmarks/user_dp_reach.py` measures what that does to RMSE)."""
    from fedrec_flwr.fedgnn.user_dp import sample_count_bound, sum_norm_bounds

    rng = np.random.default_rng(7)
    d, expected, std = 60_000, 512.0, 1.1
    users = sample_count_bound(expected)
    shapes, table = [(8,)], (d // 8 - 1, 8)

    def check(v: np.ndarray):
        return check_sum([v[:8], v[8:].reshape(table)], shapes, table, 1.0, std, expected)

    for aligned in (False, True):
        for _ in range(3):
            check(_honest_sum(rng, d, int(expected), std, aligned))  # no honest round refused
    check(_honest_sum(rng, d, int(users), std, True))  # the largest sample, all aligned: still accepted
    honest = _honest_sum(rng, d, int(expected), std, False)
    with pytest.raises(UploadRejected, match="outside"):
        check(0.9 * honest)  # the weight factor forged: every value scaled
    old_limit = users + std * (np.sqrt(d) + 6.0)
    push = np.ones(d) / np.sqrt(d)
    old_reach = -(honest @ push) + np.sqrt((honest @ push) ** 2 - honest @ honest + old_limit**2)
    assert np.linalg.norm(honest + old_reach * push) <= old_limit  # what passed before
    with pytest.raises(UploadRejected, match="outside"):
        check(honest + old_reach * push)
    # devices whose own floor is stricter (0.9 of the nodes against the run's 0.8) add smaller shares: an honest sum
    # the lower side must still accept, given the least noise honest devices can add (all nodes as the floor)
    strict = _honest_sum(rng, d, int(expected), std * np.sqrt(0.8 / 0.9), False)
    with pytest.raises(UploadRejected, match="outside"):
        check(strict)
    check_sum([strict[:8], strict[8:].reshape(table)], shapes, table, 1.0, std, expected, std * np.sqrt(0.8))
    low, high = sum_norm_bounds(d, users, 1.0, std)
    reach = -(honest @ push) + np.sqrt((honest @ push) ** 2 - honest @ honest + high)
    assert reach < 1.05 * users < 0.8 * old_reach  # a device's whole reach: about the cohort's largest signal


def test_a_short_user_dp_run_in_process_learns_and_reports_its_user_level_budget(tiny_cfg, tmp_path):
    cfg = tiny_cfg("privacy.mode=user_dp", "privacy.target_epsilon=8", "federation.rounds=12",
                   "federation.eval_every=12", "federation.clients_per_round=30", "server_opt.name=adam",
                   "server_opt.lr=0.01", "server_opt.item_lr=0.05", "local.loss=sum", "local.batch_size=1000",
                   *SMALL_EVAL)
    out = run_in_process(cfg, log_every=0)
    privacy = out["history"][-1]["privacy"]
    # sigma is calibrated to spend 8 at the noise floor (48 of 60 nodes); all 60 report, so each round carries
    # sigma sqrt(60 / 48) and is charged so
    floor = privacy["noise_floor"]["nodes"]
    assert floor == 48 and privacy["rounds"] == 12 and privacy["evaluations"] == 1
    charged = UserDPAccountant(60, privacy["sample_rate"], privacy["noise_multiplier"], 1.0, 1e-5)
    for _ in range(12):
        charged.record_round(privacy["noise_multiplier"] * np.sqrt(60 / floor))
    charged.record_evaluation(3.0 * np.sqrt(60 / floor))
    assert privacy["epsilon"] == pytest.approx(charged.epsilon(), rel=1e-9) and 5.0 < privacy["epsilon"] <= 8.0
    final = out["history"][-1]
    # what the server learns is the noisy, clipped release; the harness's exact RMSE scores every test rating
    assert np.isfinite(final["released_rmse"]) and abs(final["released_rmse"] - final["rmse"]) < 0.5
    assert out["eval_ratings"] == out["test_ratings"]  # every test rating scored
    assert np.isfinite(out["rmse"])
    again = run_in_process(cfg, log_every=0)
    assert again["rmse"] == out["rmse"]  # the same config, seed and fixed device secrets give the same numbers


@needs_superlink
def test_flwr_run_user_dp_through_secaggplus(tmp_path, capsys):
    """Through `flwr run`: registration in the clear, then every training round and the evaluation through Flower's
    SecAgg+; the result names the user-level budget, and every node's vector went up (the whole table each)."""
    out = tmp_path / "out"
    run_main(["--preset", "fedgnn_user_dp", "--dataset", "synthetic", "--out", str(out),
              "--cache-dir", str(tmp_path / "cache"), "--set", "data.synthetic.num_users=40",
              "data.synthetic.num_items=30", "data.synthetic.mean_degree=8", "model.dim=8", "federation.rounds=2",
              "federation.eval_every=2", "federation.clients_per_round=20", "simulation.users_per_node=10",
              *SURE_EVAL])
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "finished" and np.isfinite(final["rmse"])
    train = [r for r in doc["rounds"] if r.get("phase") == "train"]
    assert len(train) == 2 and all(r["applied"] and r["nodes"] == 4 and r["clients"] == 40 for r in train)
    assert all(r["bytes_up"] >= 30 * 9 * 4 for r in train)  # the whole table (30 items x (8 + 1)) per node
    assert doc["privacy"]["mode"] == "user_dp" and 0 < doc["privacy"]["epsilon"] <= 8.0
    # the evaluation went through SecAgg+ too, charged: the server holds only its noisy, clipped release
    evals = [r for r in doc["rounds"] if r.get("phase") == "evaluate-sum"]
    assert len(evals) == 1 and evals[0]["nodes"] == 4 and doc["privacy"]["evaluations"] == 1
    assert "noisy sum" in doc["final"]["released"] and np.isfinite(doc["final"]["rmse"])


def test_evaluation_releases_only_the_noisy_clipped_sum_and_charges_it(tiny_cfg):
    """Under user-level DP a device commits no test count at registration and answers no plain evaluation; its
    error sums leave only as one clipped vector of L2 norm at most 1 (whatever its ratings), summed under
    SecAgg+ with noise; the server's decoding of the sum is exact without noise, and every release is charged,
    refused or not."""
    from flwr.app import RecordDict

    from clients.fedgnn import FedGNNClient
    from clients.user_store import NodeStateStore
    from fedrec_flwr.fedgnn.bindings import NodeBindings
    from fedrec_flwr.fedgnn.rounds import FedGNNRounds
    from fedrec_flwr.fedgnn.user_dp import EVAL_ERROR_CLIP, evaluation_metrics, evaluation_vector
    from fedrec_flwr.metrics import ErrorSums
    from tests.conftest import TEST_SECRET

    worst = [ErrorSums(4.0 * 4.0 * n, 4.0 * n, n) for n in (1, 10, 1000)]  # every error at the clip, any count
    for sums in worst:
        v = evaluation_vector(sums, 2.0, 10)
        assert np.linalg.norm(v) <= 1.0 + 1e-12 and (v >= 0).all()
    assert not evaluation_vector(ErrorSums(0.0, 0.0, 0), 2.0, 10).any()

    cfg = tiny_cfg("privacy.mode=user_dp", "privacy.noise_multiplier=1", *SMALL_EVAL)
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    client = FedGNNClient(cfg, meta, [0, 1, 2], parts.user, NodeStateStore(RecordDict()), secret=TEST_SECRET)
    reply, _, _ = client.fit([], {"phase": "register", "round": 1})
    registered = split_users(reply, REGISTER_FIELDS)
    assert [int(fields[1][0]) for _, fields in registered] == [0, 0, 0]  # no test count committed
    assert sum(parts.user(u).test_items.size for u in (0, 1, 2)) > 0  # though the users hold test ratings
    with pytest.raises(ValueError, match="no plain evaluation"):
        client.evaluate([], {"phase": "train", "round": 2})

    # decoding: without noise, users below the weight cap (and the L2 clip) give back the RMSE and MAE exactly
    users = [ErrorSums(0.5, 1.0, 2), ErrorSums(1.0, 1.5, 2), ErrorSums(0.25, 0.5, 1)]
    clip = EVAL_ERROR_CLIP * 4.0
    total = sum(evaluation_vector(s, clip, 4) for s in users)
    rmse, mae, weighted = evaluation_metrics([total], 4.0, 4, 3, 0.0)
    assert rmse == pytest.approx(np.sqrt(1.75 / 5), rel=1e-9) and mae == pytest.approx(3.0 / 5, rel=1e-9)
    assert weighted == pytest.approx(5.0)

    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    rounds = FedGNNRounds.from_config(cfg, server, NodeBindings(meta.num_users, block_size=1), 4.0)
    rounds.evaluate_sum(3, [np.array([1e9, 0.0, 1.0])], 60, [], 0.0, 0.0, 0.0)  # refused: past any honest sum
    assert rounds.final == {} and rounds.mechanism.ledger.budget()["evaluations"] == 1  # released, so charged
    rounds.evaluate_sum(4, [total.astype(np.float32)], 60, [], 0.0, 0.0, 0.0)
    assert rounds.mechanism.ledger.budget()["evaluations"] == 2 and "noisy sum" in rounds.final["released"]
    assert rounds.final["rmse"] == pytest.approx(clip * np.sqrt(total[0] / total[2]), rel=1e-6)


def test_a_non_finite_download_is_refused_and_a_non_finite_user_adds_nothing(tiny_cfg):
    """A NaN in one item row would turn exactly the updates or error sums of the users who rated it into NaN,
    which SecAgg+ quantises to a constant no noise hides: the device refuses such a download before touching any
    user's data, and a user whose update or error sums still come out non-finite contributes zero. The released
    evaluation's scale is the same for every user, so a perfect user and a user at the error clip decode to their
    exact clipped RMSE (a data-dependent scale biased it low)."""
    from fedrec_flwr.fedgnn.user_dp import evaluation_metrics, evaluation_vector
    from fedrec_flwr.metrics import ErrorSums

    cfg = tiny_cfg("privacy.mode=user_dp", "privacy.noise_multiplier=1")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    user = FedGNNUser(DeviceSections.from_config(cfg), meta, parts.user(3), MemoryStore())
    table = server.table().copy()
    table[int(parts.user(3).train_items[0])] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        node_update([user], server.model_weights(), table, 2, None, 8, 1.0, 0.0)

    grads = [np.full(5, np.nan, np.float32), np.ones(5, np.float32) * 0.1]
    rows = [np.full((2, 4), np.nan, np.float32), np.ones((1, 4), np.float32) * 0.1]
    node = NodeSum([(5,)], 10, 4, 1.0, torch.device("cpu"))
    node.add(_steps(grads, rows), [np.array([1, 2]), np.array([3])])
    model, table_sum = node.noised(0.0, np.random.default_rng(0))
    assert np.isfinite(model).all() and np.isfinite(table_sum).all()
    np.testing.assert_allclose(model, grads[1], rtol=1e-6)  # only the finite user's update
    assert not table_sum[[1, 2]].any()
    for odd in (ErrorSums(float("nan"), 1.0, 3), ErrorSums(-1e30, 0.0, 3), ErrorSums(0.0, -1e30, 3),
                ErrorSums(1.0, 1.0, -5), ErrorSums(float("inf"), float("inf"), 3)):
        v = evaluation_vector(odd, 2.0, 10)
        assert np.isfinite(v).all() and (v >= 0).all() and np.linalg.norm(v) <= 1.0 + 1e-12, (odd, v)
    with pytest.raises(ValueError, match="int64"):
        node_update([user], [w.astype(np.int64) for w in server.model_weights()], server.table(), 2, None, 8, 1.0, 0.0)

    perfect, worst = ErrorSums(0.0, 0.0, 10), ErrorSums(40.0, 20.0, 10)  # every error at the clip (2)
    total = evaluation_vector(perfect, 2.0, 10) + evaluation_vector(worst, 2.0, 10)
    rmse, mae, weighted = evaluation_metrics([total], 4.0, 10, 2, 0.0)
    assert rmse == pytest.approx(np.sqrt(40.0 / 20), rel=1e-9) and mae == pytest.approx(1.0, rel=1e-9)
    assert weighted == pytest.approx(20.0)


def test_a_deployed_device_computes_as_long_whatever_its_coins_say_and_adds_only_its_sampled_users(tiny_cfg):
    """Reply timing: with cover steps a device runs the local step for every user, sampled or not, so how long it
    computes does not show its coins (the server controls the step's size, so a fixed deadline alone does not
    hide them). A cover step adds nothing and keeps nothing: the vector and the stored states equal those of a
    node that trained only its sampled users."""
    cfg = tiny_cfg("privacy.mode=user_dp", "model.dropout=0")
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint)
    device_cfg = DeviceSections.from_config(cfg)
    outs, stores, trained = [], [], []
    for cover in (False, True):
        store = MemoryStore()
        users = [FedGNNUser(device_cfg, meta, parts.user(u), store) for u in range(8)]
        computed = []
        import fedrec_flwr.fedgnn.user_dp as user_dp_module
        original = user_dp_module.run_local_steps

        def counting(work, *args, **kwargs):
            computed.append(len(work))
            return original(work, *args, **kwargs)

        user_dp_module.run_local_steps = counting
        try:
            outs.append(node_update(users, server.model_weights(), server.table(), 3, None, 8, 0.5, 0.0, cover=cover))
        finally:
            user_dp_module.run_local_steps = original
        stores.append({u: st.embedding.copy() for u, st in store.states.items()})
        trained.append(computed[0])
    assert trained[1] == 8 and trained[0] < 8  # cover: every user computes; without: only the sampled ones
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert stores[0].keys() == stores[1].keys()  # only sampled users keep a new state
    for u in stores[0]:  # batched with other users: the same arithmetic up to float32 reassociation
        np.testing.assert_allclose(stores[0][u], stores[1][u], rtol=1e-5, atol=1e-7)


def test_when_every_user_is_asked_the_sum_check_allows_exactly_the_runs_users_and_no_more():
    """q = 1 (the preset on datasets of up to 4,096 users): the sampled count is N, not a Poisson count, so the
    check's signal budget is N clipped updates. A device adding one more user's aligned clipped update on top of N
    aligned honest ones is refused, where the Poisson tail (N + 6 sqrt(N)) would have let ~6 sqrt(N) of them in."""
    from fedrec_flwr.fedgnn.user_dp import sample_count_bound

    n = 943
    assert sample_count_bound(float(n), n) == n
    assert sample_count_bound(float(n)) > n + 6 * np.sqrt(n) - 1  # without N: the Poisson tail
    assert 512 < sample_count_bound(512.0, 3000) < 512 + 6 * np.sqrt(512)  # sampled rounds: a binomial tail
    assert sample_count_bound(2999.0, 3000) <= 3000
    rng = np.random.default_rng(3)
    d, std = 60_000, 1.1
    shapes, table = [(8,)], (d // 8 - 1, 8)

    def check(v: np.ndarray):
        return check_sum([v[:8], v[8:].reshape(table)], shapes, table, 1.0, std, float(n), None, n)

    honest = _honest_sum(rng, d, n, std, True)  # all N users, all aligned: the largest honest signal
    check(honest)
    forged = honest + 40.0 * np.ones(d) / np.sqrt(d)  # 40 more aligned clipped updates than the run has users
    with pytest.raises(UploadRejected, match="outside"):
        check(forged)
    check_sum([forged[:8], forged[8:].reshape(table)], shapes, table, 1.0, std, float(n))  # the Poisson tail's pass
