"""DP-FTRL with tree aggregation (Kairouz et al. 2021) against `fedgnn_user_dp`'s Poisson-sampled Gaussian, at the
same user-level budget: what the noise costs each, computed and measured.

    python -m benchmarks.user_dp_ftrl --data-dir DATA [--datasets ml-100k douban] [--epsilon 8]
        [--shapes 2x50 10x10] [--seeds 0] [--clients-per-round 512] [--no-runs] [--resume]

The mechanism. Each epoch, every user takes part in exactly one of k rounds, its slot drawn from its own id and
the epoch alone (so adding or removing a user moves no other user's slot; cohorts are about N / k), and T = k E
rounds make E epochs. The server releases the prefix sums of an epoch's
clipped round sums through a binary tree restarted every epoch: each dyadic node of the tree carries its own
N(0, (sigma C)^2) per coordinate, and a round's noisy sum is the difference of two consecutive noisy prefix sums,
which the server's optimiser (the preset's Adam, a post-processing) steps on. No sampling amplification is used.

Accounting. A user sits in one leaf a tree, so it changes at most depth = ceil(log2(k + 1)) nodes by at most C:
each epoch is one Gaussian release of multiplier sigma / sqrt(depth) (add or remove one user), E of them composed
with the run's released evaluation by dp-accounting's RDP accountant, exactly as the preset's evaluation is charged.
`check_against_dp_accounting` checks that this is dp-accounting's own `SingleEpochTreeAggregationDpEvent` (whose RDP
it defines under REPLACE_SPECIAL) at several (sigma, k), and `check_tree` the tree itself; both run first, every
time.

What is computed, for every (k, E) and epsilon: the noise std that lands in the final parameters of a linear
(FTRL / SGD) update per unit of training (learning rate times rounds): eta sqrt(E popcount(k)) sigma C k / N over
eta T for the tree (each epoch's last prefix sum holds popcount(k) nodes), against eta sqrt(T) sigma C / (q N) over
eta T for the Poisson-sampled Gaussian at q = --clients-per-round / N (512, the measured preset's, by default):
below 1, the tree puts less noise in the model for the same progress.

What is measured: in-process runs of the preset (its round core, local steps and clip) in which the slots replace
each user's coin, the divisor is N / k, the devices' noise is off and the tree noise is added to each round's sum
before the server's step, which stays the preset's Adam. Adam is a post-processing, so the budget holds, but the
tree's noise cancels over the rounds only under a linear update: the runs measure the tree's noise with this
model's optimiser, not FTRL proper. The tree's noise is exactly sigma C, spending the whole epsilon, where the
preset's devices size their shares for a noise floor (0.8 of the nodes: 1.118 sigma C with every node, 7.0 of
8 spent), which favours the tree by about 12% less noise. The product does not ship the mechanism; see
docs/benchmarks/user-dp.md. Resumable: finished cells are kept in benchmarks/results/user_dp_ftrl.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_data_dir, add_resume, markdown_table, results_file
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn import user_dp as user_dp_core
from fedrec_flwr.fedgnn.accounting import _quiet_absl, calibrate_noise_multiplier, gaussian_releases_sigma, sample_rate
from fedrec_flwr.fedgnn.modes import user_dp as user_dp_mode
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.reference.baselines import baseline_rmses

OUT = Path("benchmarks/results/user_dp_ftrl.json")
DELTA = 1e-5
EVAL_SHARE = 0.1  # the preset's privacy.eval_budget_share: one released evaluation at the end
REGISTER_ROUNDS = 1  # the run's first logical round registers the nodes; training starts at the second
NO_DEVICE_NOISE = ["privacy.noise_multiplier=1e-6", "privacy.target_epsilon=0", "privacy.eval_noise_multiplier=1e-6"]


def tree_depth(k: int) -> int:
    """How many nodes of a binary tree over k leaves hold one leaf (the leaf and its ancestors): ceil(log2(k + 1)),
    dp-accounting's depth for a tree of k steps."""
    return math.ceil(math.log2(k + 1))


def prefix_nodes(t: int) -> list[tuple[int, int]]:
    """The dyadic nodes (level, index) whose leaves make up the prefix 1..t of a tree (t >= 0): one per set bit of t,
    the node at level l covering leaves index * 2^l + 1 .. (index + 1) * 2^l."""
    nodes, start = [], 0
    for level in reversed(range(max(t.bit_length(), 1))):
        if t >> level & 1:
            nodes.append((level, start >> level))
            start += 1 << level
    return nodes


class TreeNoise:
    """The noise of one tree: each dyadic node's N(0, std^2) per coordinate drawn once, when first used, and a round's
    noise the difference of the noisy prefix sums at t and t - 1."""

    def __init__(self, shapes: list[tuple[int, ...]], std: float, rng: np.random.Generator):
        self.shapes, self.std, self.rng = shapes, std, rng
        self.nodes: dict[tuple[int, int], list[np.ndarray]] = {}

    def _node(self, key: tuple[int, int]) -> list[np.ndarray]:
        if key not in self.nodes:
            self.nodes[key] = [self.std * self.rng.standard_normal(s).astype(np.float32) for s in self.shapes]
        return self.nodes[key]

    def prefix(self, t: int) -> list[np.ndarray]:
        """The noise on the released prefix sum of rounds 1..t of this tree."""
        out = [np.zeros(s, np.float32) for s in self.shapes]
        for key in prefix_nodes(t):
            for acc, z in zip(out, self._node(key)):
                acc += z
        return out

    def round(self, t: int) -> list[np.ndarray]:
        """The noise on round t's sum as the server derives it: prefix(t) - prefix(t - 1)."""
        return [a - b for a, b in zip(self.prefix(t), self.prefix(t - 1))]


def tree_noise_multiplier(k: int, epochs: int, epsilon: float, delta: float = DELTA,
                          eval_sigma: float | None = None) -> float:
    """sigma of each tree node such that E restarted trees of k rounds, beside the run's released evaluation (at
    `eval_sigma`; the preset's when None), spend `epsilon` at `delta`, add or remove one user: each tree is one
    Gaussian release of multiplier sigma / sqrt(depth), so sigma is sqrt(depth) times the multiplier of E plain
    Gaussian releases beside the evaluation (the project's calibration, `accounting.calibrate_noise_multiplier` at
    q = 1)."""
    eval_sigma = gaussian_releases_sigma(1, EVAL_SHARE * epsilon, delta) if eval_sigma is None else eval_sigma
    return math.sqrt(tree_depth(k)) * calibrate_noise_multiplier(1.0, epochs, epsilon, delta, 1, eval_sigma)


def check_against_dp_accounting() -> float:
    """The largest relative difference between the epsilon of one tree as this accounting charges it (a Gaussian of
    multiplier sigma / sqrt(depth), add or remove one user) and dp-accounting's own `SingleEpochTreeAggregationDpEvent`
    (REPLACE_SPECIAL), over several (sigma, k, delta); AssertionError above 1e-9."""
    import dp_accounting
    from dp_accounting import rdp

    _quiet_absl()
    worst = 0.0
    for sigma in (0.7, 2.0, 6.5):
        for k in (1, 2, 3, 10, 100):
            theirs = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
            theirs.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, k),
                                                             10))
            mine = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
            mine.compose(dp_accounting.SelfComposedDpEvent(
                dp_accounting.GaussianDpEvent(sigma / math.sqrt(tree_depth(k))), 10))
            for delta in (1e-5, 1e-3):
                a, b = theirs.get_epsilon(delta), mine.get_epsilon(delta)
                worst = max(worst, abs(a - b) / b)
    assert worst < 1e-9, f"tree accounting differs from dp-accounting's by {worst:g}"
    return worst


def check_tree(max_rounds: int = 130) -> None:
    """AssertionError unless, for every tree of up to `max_rounds` rounds: each prefix is covered by disjoint dyadic
    nodes, one per set bit; a leaf sits in at most depth of the nodes a prefix uses (the sensitivity the accounting
    charges); and the rounds' noises the server derives add up to the released prefix's noise."""
    used: set[tuple[int, int]] = set()  # the nodes the prefixes 1..k use, grown with k
    for k in range(max_rounds + 1):
        nodes = prefix_nodes(k)
        leaves = [leaf for level, index in nodes for leaf in range(index << level, (index + 1) << level)]
        assert sorted(leaves) == list(range(k)) and len(nodes) == k.bit_count(), k
        used.update(nodes)
        for leaf in range(k):
            assert sum(index << level <= leaf < (index + 1) << level for level, index in used) <= tree_depth(k), k
    tree = TreeNoise([(3,), (2, 2)], 1.5, np.random.default_rng(0))
    total = [np.zeros(3, np.float32), np.zeros((2, 2), np.float32)]
    for t in range(1, 40):
        total = [a + z for a, z in zip(total, tree.round(t))]
        for a, b in zip(total, tree.prefix(t)):
            assert np.allclose(a, b, atol=1e-4), t


def noise_per_progress(k: int, epochs: int, epsilon: float, num_users: int, clients_per_round: int) -> dict:
    """The noise std in the final parameters of a linear update per unit of training (eta T), for the tree and for
    the Poisson-sampled Gaussian at q = clients_per_round / N over the same T = k E rounds at the same budget
    (evaluation charged alike), in units of C."""
    rounds = k * epochs
    q = sample_rate(clients_per_round, num_users)
    eval_sigma = gaussian_releases_sigma(1, EVAL_SHARE * epsilon, DELTA)
    sgd_sigma = calibrate_noise_multiplier(q, rounds, epsilon, DELTA, 1, eval_sigma)
    tree_sigma = tree_noise_multiplier(k, epochs, epsilon, DELTA, eval_sigma)
    tree = math.sqrt(epochs * k.bit_count()) * tree_sigma * k / num_users / rounds  # the last prefix: popcount(k)
    sgd = math.sqrt(rounds) * sgd_sigma / (q * num_users) / rounds
    return {"k": k, "epochs": epochs, "rounds": rounds, "epsilon": epsilon, "tree_sigma": tree_sigma,
            "sgd_sigma": sgd_sigma, "q": q, "tree_noise_per_progress": tree, "sgd_noise_per_progress": sgd,
            "ratio": tree / sgd}


@contextmanager
def ftrl_mechanism(k: int, epochs: int, sigma: float, clip: float, num_users: int, seed: int):
    """Within it, the preset's user-DP round runs as DP-FTRL: each user's slot in each epoch instead of its coin, N / k
    as the divisor and the tree's noise on each applied sum (see the module's docstring). Yields the record of rounds
    applied."""
    rng = np.random.default_rng([seed, 0xF7])
    # a user's slot depends on its own id and the epoch only: a neighbouring dataset moves no other user
    cohorts = [np.array([np.random.default_rng([seed, 0xF7, e, u]).integers(k) for u in range(num_users)])
               for e in range(epochs)]
    state = {"applied": 0, "tree": None, "epoch": -1, "coin_round": -1}
    coin, divisor, apply = user_dp_core.samples_itself, user_dp_mode.Server.expected_users, FedGNNServer.apply_sum

    def in_cohort(secret, user, server_round, q, attempt=0):
        state["coin_round"] = server_round
        epoch, slot = divmod(server_round - 1 - REGISTER_ROUNDS, k)  # training rounds from 0
        return epoch < epochs and bool(cohorts[epoch][user] == slot)

    def noisy_apply(self, model_sums, table_sum, users):
        epoch, slot = divmod(state["applied"], k)
        if state["coin_round"] - 1 - REGISTER_ROUNDS != state["applied"]:
            raise RuntimeError(f"round {state['coin_round']}'s cohort is not tree leaf {state['applied']}: a user "
                               "could sit in two leaves of one tree")
        if epoch != state["epoch"]:
            shapes = [np.shape(g) for g in model_sums] + [np.shape(table_sum)]
            state["tree"], state["epoch"] = TreeNoise(shapes, sigma * clip, rng), epoch
        *model_noise, table_noise = state["tree"].round(slot + 1)
        state["applied"] += 1
        return apply(self, [g + z for g, z in zip(model_sums, model_noise)], table_sum + table_noise, users)

    user_dp_core.samples_itself = in_cohort
    user_dp_mode.Server.expected_users = lambda self: self.rounds.bindings.num_users / k
    FedGNNServer.apply_sum = noisy_apply
    try:
        yield state
    finally:
        user_dp_core.samples_itself, user_dp_mode.Server.expected_users, FedGNNServer.apply_sum = coin, divisor, apply


def run_ftrl(dataset: str, k: int, epochs: int, epsilon: float, seed: int, data_dir: str) -> dict:
    """One in-process DP-FTRL run of the preset: final exact RMSE, the split's baselines, sigma and the budget."""
    rounds = k * epochs
    cfg = load_config("fedgnn_user_dp", dataset, [f"data.data_dir={data_dir}", f"seed={seed}",
                                                   f"federation.rounds={rounds}", f"federation.eval_every={rounds}",
                                                   *NO_DEVICE_NOISE])
    partitions = UserPartitions(prepare_partitions(cfg.data))
    num_users = partitions.meta.num_users
    sigma = tree_noise_multiplier(k, epochs, epsilon)
    torch.set_num_threads(1)
    started = time.time()
    with ftrl_mechanism(k, epochs, sigma, cfg.privacy.clip_norm, num_users, seed) as state:
        out = run_in_process(cfg, log_every=0)
    if state["applied"] != rounds:
        raise RuntimeError(f"{state['applied']} of {rounds} rounds applied: the tree's noise would be misaligned")
    return {"final_rmse": out["rmse"], "test_ratings": out["test_ratings"], "tree_sigma": sigma,
            "depth": tree_depth(k), "users_per_round": num_users / k,
            "baselines": baseline_rmses(partitions.ratings()), "wall_seconds": round(time.time() - started, 1),
            "date": date.today().isoformat()}


def main() -> None:
    """Check the accounting, print the computed comparison, run the missing cells and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--shapes", nargs="+", default=["2x50", "10x10"], help="k x E: rounds an epoch x epochs")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--clients-per-round", type=int, default=512,
                    help="the sampled Gaussian the computed table compares with: q = this / N")
    ap.add_argument("--no-runs", action="store_true", help="only the accounting checks and the computed table")
    ap.add_argument("--out", type=Path, default=OUT)
    add_resume(ap)
    args = ap.parse_args()
    path = results_file(args.out, args.resume)
    doc = json.loads(path.read_text()) if path.is_file() else {"runs": [], "computed": []}
    check_tree()
    doc["accounting_check"] = {"max_relative_rdp_difference": check_against_dp_accounting(),
                               "against": "dp_accounting SingleEpochTreeAggregationDpEvent (REPLACE_SPECIAL)"}
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    users = {}
    for dataset in args.datasets:
        cfg = load_config("fedgnn_user_dp", dataset, [f"data.data_dir={args.data_dir}"])
        users[dataset] = (UserPartitions(prepare_partitions(cfg.data)).meta.num_users, args.clients_per_round)
    fresh = [{"dataset": d, **noise_per_progress(k, e, eps, n, c)}
             for d, (n, c) in users.items() for k, e in dict.fromkeys([(1, 100), *shapes, (100, 1)])
             for eps in (1.0, 2.0, 4.0, 8.0, 16.0)]
    cells = {(c["dataset"], c["k"], c["epochs"], c["epsilon"], c["q"]): c for c in [*doc["computed"], *fresh]}
    doc["computed"] = list(cells.values())  # earlier cells kept, the same ones recomputed
    atomic_write(path, json.dumps(doc, indent=1) + "\n")
    print(markdown_table(["dataset", "k x E", "epsilon", "tree sigma", "sampled q", "sampled sigma",
                          "tree noise / sampled noise"],
                         [[c["dataset"], f"{c['k']}x{c['epochs']}", f"{c['epsilon']:g}", f"{c['tree_sigma']:.3f}",
                           f"{c['q']:.3f}", f"{c['sgd_sigma']:.3f}", f"{c['ratio']:.2f}"] for c in doc["computed"]]))
    rows = []
    for dataset in [] if args.no_runs else args.datasets:
        for k, e in shapes:
            for seed in args.seeds:
                key = {"dataset": dataset, "k": k, "epochs": e, "target_epsilon": args.epsilon, "seed": seed}
                run = next((r for r in doc["runs"] if all(r.get(a) == b for a, b in key.items())), None)
                if run is None:
                    print(f"[user_dp_ftrl] {dataset} k={k} E={e} seed {seed} ...", flush=True)
                    run = {**key, **run_ftrl(dataset, k, e, args.epsilon, seed, args.data_dir),
                           "command": f"python -m benchmarks.user_dp_ftrl --data-dir DATA --datasets {dataset} "
                                      f"--epsilon {args.epsilon:g} --shapes {k}x{e} --seeds {seed}"}
                    doc["runs"].append(run)
                    atomic_write(path, json.dumps(doc, indent=1) + "\n")
                b = run["baselines"]
                rows.append([dataset, f"{k}x{e}", seed, f"{run['tree_sigma']:.3f}", f"{run['final_rmse']:.4f}",
                             f"{b['item_mean']:.4f} / {b['bias']:.4f}"])
    print(markdown_table(["dataset", "k x E", "seed", "tree sigma", "test RMSE", "item mean / bias model"], rows))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
