"""How far one device, or 1% of them, moves a user-DP model: the strongest additions the server accepts.

    python -m benchmarks.user_dp_reach --data-dir DATA [--dataset ml-100k] [--rounds 100] [--seeds 0]

Under `privacy.mode = user_dp` the server sees only the SecAgg+ sum. Flower's per-coordinate clipping and
weight factor are applied by each client's own `secaggplus_mod`, so a device running modified code can put any
value in its masked vector; all that bounds it is what the server accepts of the *sum*
(`fedrec_flwr.fedgnn.user_dp.check_sum`). Each training round every cell adds one vector v to the honest
noisy sum, at the largest length the bound accepts (solved exactly from the honest sum, which the attacker is
given: an upper bound on what a device can reach). Directions:
- `reverse-last`: against the model's last public change (every device sees it in its downloads): ascent;
- `constant`: every coordinate the same sign (a shift of every item row and bias);
- `reverse-sum`: against this round's honest noisy sum (omniscient: the strongest single direction).
Bounds:
- `l2-linear`: the check before 2026-12-04 (|sum| <= U C + s (sqrt d + 6));
- `chi-square`: today's two-sided check (`user_dp.sum_norm_bounds`), which also defeats forged SecAgg+ weights;
- `per-node-verified` (a design, not in Flower): each device proves its vector's norm is within what an honest
  one-user device reaches, C + its noise share's chi tail (a zero-knowledge norm proof or a two-server
  Prio-style check), so m colluding devices add at most m times that; the sum check still applies.
Under the sum checks one device and 1% of them reach the same (the bound is on the sum), so the 1% cells are
run only where it differs. One user per device (a deployment); the same fixed device secrets in every cell,
so a cell differs from the clean run only by the attack. In-process, the exact RMSE on every test rating.
Writes benchmarks/results/user_dp_reach.json (resumable: finished cells are kept).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_data_dir, add_resume, results_file
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.fedgnn import rounds as rounds_module
from fedrec_flwr.fedgnn import user_dp
from fedrec_flwr.fedgnn.user_dp import TAIL_LOG, sample_count_bound
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.privacy.device_secret import DeviceSecret
from fedrec_flwr.reporting.results import RunFailed

DIRECTIONS = ("reverse-last", "constant", "reverse-sum")
BOUNDS = ("l2-linear", "chi-square", "per-node-verified")
OUT = Path("benchmarks/results/user_dp_reach.json")


def linear_high(coordinates: int, users: float, clip_norm: float, noise_std: float) -> float:
    """The squared norm the server accepted before 2026-12-04: (U C + s (sqrt d + 6))^2, no lower bound."""
    return (users * clip_norm + noise_std * (math.sqrt(coordinates) + 6.0)) ** 2


def device_norm_bound(coordinates: int, clip_norm: float, share_std: float) -> float:
    """The longest vector an honest one-user device sends: its clipped update plus its noise share's chi tail."""
    d = float(coordinates)
    return clip_norm + share_std * math.sqrt(d + 2.0 * math.sqrt(d * TAIL_LOG) + 2.0 * TAIL_LOG)


def longest_step(agg: np.ndarray, unit: np.ndarray, low: float, high: float, cap: float) -> float:
    """The largest beta in [0, cap] with low <= |agg + beta unit|^2 <= high (unit of norm 1): the attacker's longest
    addition the server accepts (a stealthy attacker stays accepted; 0 when none is)."""
    b, a2 = float(agg @ unit), float(agg @ agg)

    def roots(level: float) -> tuple[float, float] | None:  # where |agg + beta unit|^2 = level
        disc = b * b - (a2 - level)
        return None if disc < 0 else (-b - math.sqrt(disc), -b + math.sqrt(disc))

    inside = roots(high)
    if inside is None or inside[1] < 0:
        return 0.0
    beta = min(cap, inside[1] * (1 - 1e-4))  # just inside: the server checks the float32 sum
    hole = roots(low)  # (beta3, beta4): too short a sum
    if hole is not None and hole[0] < beta < hole[1]:
        beta = hole[0] * (1 - 1e-4)
    return beta if beta >= max(inside[0], 0.0) else 0.0


class Attacker:
    """Adds its vector to each training round's sum before the server's check, and records its lengths."""

    def __init__(self, direction: str, bound: str, fraction: float):
        self.direction, self.bound, self.fraction = direction, bound, fraction
        self.devices = 1  # fraction 0: one device; else ceil(fraction x users), set on the first round
        self.last_change: np.ndarray | None = None
        self.lengths: list[float] = []
        self.honest_norms: list[float] = []

    def vector(self, rounds, summed: list[np.ndarray]) -> np.ndarray:
        """This round's addition, flattened in the sum's order."""
        agg = np.concatenate([np.asarray(a, np.float64).ravel() for a in summed])
        self.honest_norms.append(float(np.linalg.norm(agg)))
        d, clip = agg.size, rounds.privacy.clip_norm
        nodes = rounds.bindings.run_nodes
        if self.fraction:
            self.devices = max(1, math.ceil(self.fraction * rounds.bindings.num_users))
        std = rounds.mechanism.charged_multiplier(nodes) * clip
        users = sample_count_bound(rounds.mechanism.expected_users())
        if self.direction == "reverse-last":
            if self.last_change is None or not np.any(self.last_change):
                return np.zeros(d)
            unit = -self.last_change
        elif self.direction == "constant":
            unit = np.ones(d)
        else:
            unit = -agg
        unit = unit / np.linalg.norm(unit)
        low, high = user_dp.sum_norm_bounds(d, users, clip, std)  # the server's check in this cell
        cap = math.inf
        if self.bound == "per-node-verified":
            share = rounds.mechanism.ledger.sigma * clip / math.sqrt(rounds.mechanism.secure_floor)
            cap = self.devices * device_norm_bound(d, clip, share)
        beta = longest_step(agg, unit, low, high, cap)
        self.lengths.append(beta)
        return beta * unit


@contextmanager
def attacking(attacker: Attacker | None):
    """Route every user-DP training sum through `attacker` (None: the clean run) for the duration."""
    original = rounds_module.FedGNNRounds.train_sum

    def train_sum(self, logical_round, summed, *args, **kwargs):
        if attacker is None or summed is None:
            return original(self, logical_round, summed, *args, **kwargs)
        flat = attacker.vector(self, summed)
        out, at = [], 0
        for a in summed:
            a = np.asarray(a, np.float64)
            out.append(a + flat[at: at + a.size].reshape(a.shape))
            at += a.size
        before = np.concatenate([*(w.ravel() for w in self.server.model_weights()), self.server.table().ravel()])
        record = original(self, logical_round, out, *args, **kwargs)
        after = np.concatenate([*(w.ravel() for w in self.server.model_weights()), self.server.table().ravel()])
        attacker.last_change = after - before
        return record

    original_bounds = user_dp.sum_norm_bounds
    rounds_module.FedGNNRounds.train_sum = train_sum
    if attacker is not None and attacker.bound == "l2-linear":  # the server's check as it was
        user_dp.sum_norm_bounds = lambda d, users, clip, std: (0.0, linear_high(d, users, clip, std))
    try:
        yield
    finally:
        rounds_module.FedGNNRounds.train_sum = original
        user_dp.sum_norm_bounds = original_bounds


def run_cell(cfg_args: tuple, secrets: Path, direction: str | None, bound: str | None, fraction: float) -> dict:
    """One in-process run under one attack (None: clean); its exact test RMSE, refusals and attack lengths."""
    preset, dataset, data_dir, rounds, seed = cfg_args
    cfg = load_config(preset, dataset, [f"data.data_dir={data_dir}", f"seed={seed}", f"federation.rounds={rounds}",
                                        f"federation.eval_every={rounds}", f"simulation.device_secrets={secrets}"])
    attacker = Attacker(direction, bound, fraction) if direction else None
    t0 = time.time()
    try:
        with attacking(attacker):
            out = run_in_process(cfg, log_every=0)
        rmse, refused = out["rmse"], sum(1 for r in out["history"] if r.get("phase") == "train" and not r["applied"])
    except RunFailed as exc:  # every round refused: the attack stopped training, which the record says
        rmse, refused = None, f"all: {exc}"[:300]
    cell = {"direction": direction or "none", "bound": bound or "none", "seed": seed,
            "devices": attacker.devices if attacker else 0, "rmse": rmse, "rounds_refused": refused,
            "wall_seconds": round(time.time() - t0, 1)}
    if attacker is not None:
        cell["median_attack_norm"] = statistics.median(attacker.lengths) if attacker.lengths else 0.0
        cell["median_honest_sum_norm"] = statistics.median(attacker.honest_norms)
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--dataset", default="ml-100k")
    ap.add_argument("--preset", default="fedgnn_user_dp")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--fraction", type=float, default=0.01, help="share of devices in the colluding cells")
    ap.add_argument("--out", type=Path, default=OUT)
    add_resume(ap)
    ap.add_argument("--secrets", type=Path, default=Path("/tmp/fedrec-user-dp-reach-secrets"),
                    help="the simulation's device secrets (drawn on first use); every cell of --out uses the same")
    args = ap.parse_args()
    args.out = results_file(args.out, args.resume)
    torch.set_num_threads(1)  # one core: the machine's other runs keep theirs
    doc = json.loads(args.out.read_text()) if args.out.exists() else {"cells": []}
    doc.update({"preset": args.preset, "dataset": args.dataset, "rounds": args.rounds})
    secrets = args.secrets
    if not secrets.exists():
        secrets.write_text(DeviceSecret.fresh().hex_for_node_state() + "\n")
        secrets.chmod(0o600)
    fingerprint = DeviceSecret.from_node_state(secrets.read_text().strip()).fingerprint()
    if doc.setdefault("device_secrets_fingerprint", fingerprint) != fingerprint:
        raise SystemExit(f"{args.out} was measured with other device secrets ({doc['device_secrets_fingerprint']}); "
                         f"pass that run's --secrets file, or another --out")
    for seed in args.seeds:
        plan: list[tuple[str | None, str | None, float]] = [(None, None, 0.0)]
        plan += [(d, b, 0.0) for b in BOUNDS for d in DIRECTIONS]
        plan += [(d, "per-node-verified", args.fraction) for d in DIRECTIONS]
        for direction, bound, fraction in plan:
            if any(c["seed"] == seed and c["direction"] == (direction or "none") and c["bound"] == (bound or "none")
                   and (c["devices"] > 1) == (fraction > 0) for c in doc["cells"]):
                continue  # finished on an earlier run
            cell = run_cell((args.preset, args.dataset, args.data_dir, args.rounds, seed), secrets, direction,
                            bound, fraction)
            cell["date"] = date.today().isoformat()
            doc["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            atomic_write(args.out, json.dumps(doc, indent=1))
    seeds = sorted({c["seed"] for c in doc["cells"]})
    doc["command"] = (f"python -m benchmarks.user_dp_reach --data-dir DATA --dataset {args.dataset} --rounds "
                      f"{args.rounds} --seeds {' '.join(map(str, seeds))}")
    clean = {c["seed"]: c["rmse"] for c in doc["cells"] if c["direction"] == "none"}
    for c in doc["cells"]:
        if c["direction"] != "none" and c["seed"] in clean and c["rmse"] is not None:
            c["rmse_shift"] = c["rmse"] - clean[c["seed"]]
    atomic_write(args.out, json.dumps(doc, indent=1))
    print(table(doc))


def table(doc: dict) -> str:
    """Markdown: the RMSE shift of each (bound, direction, devices) cell, mean over seeds."""
    rows = ["| bound | direction | devices | RMSE shift | median attack norm | median honest sum norm |",
            "|---|---|---|---|---|---|"]
    keys = sorted({(c["bound"], c["direction"], c["devices"]) for c in doc["cells"] if c["direction"] != "none"})
    for b, d, m in keys:
        cs = [c for c in doc["cells"] if (c["bound"], c["direction"], c["devices"]) == (b, d, m) and "rmse_shift" in c]
        if cs:
            rows.append(f"| {b} | {d} | {m} | {statistics.mean(c['rmse_shift'] for c in cs):+.4f} | "
                        f"{statistics.mean(c['median_attack_norm'] for c in cs):.1f} | "
                        f"{statistics.mean(c['median_honest_sum_norm'] for c in cs):.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
