"""Poisoned uploads against the FedGNN server: final RMSE with and without the robust merge.

    python -m benchmarks.poisoning [--preset quickstart] [--rounds 60] [--out benchmarks/results/poisoning.json]

A seeded fraction of users (e.g. 5, 10 or 20% of all users, so about that share of every round's
sample) replace their protected upload by an attack:
- `coordinated-at-bound`: every attacker sets every coordinate to the same sign at 0.999 x the LDP
  coordinate bound (inside the coordinate bound, far outside the L1 norm an honest upload has);
- `strongest-passing`: every attacker sets every coordinate of each block (model gradients; item rows)
  to the same sign at 0.999 x the block's L1 limit / its size (about delta + lambda): the largest
  coordinated push that passes every check of `fedrec_flwr.fedgnn.bounds`;
- `flip-at-bound`: every coordinate set to -sign(honest value) x 0.99 x the coordinate bound;
- `flip`: the honest protected upload negated;
- `scaled`: the honest protected upload times 100.
Each run uses the same seed, so it differs from the clean run only by the attack. Runs in-process
through the same round core as `flwr run` (fedrec_flwr.cli.inprocess). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date

import numpy as np
import torch

from benchmarks.common import add_data_dir, markdown_table
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.cli.runner import input_errors_exit
from fedrec_flwr.config import load_config, parse_overrides
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.bounds import PER_CHECK, ldp_coordinate_bound, ldp_l1_bound

ATTACKS = ("coordinated-at-bound", "strongest-passing", "flip-at-bound", "flip", "scaled")


def attack(kind: str, upload: list[np.ndarray], bound: float, privacy=None) -> list[np.ndarray]:
    """The poisoned version of one user's protected upload [*model grads, ids, rows] (ids kept); `bound` is the
    LDP coordinate bound, `privacy` the run's section (for the L1 limits of `strongest-passing`)."""
    *grads, ids, rows = upload
    if kind == "coordinated-at-bound":
        def push(a):
            return np.full(np.shape(a), 0.999 * bound, np.float32)
    elif kind == "strongest-passing":
        model_size = sum(np.asarray(g).size for g in grads)

        def level(size: int) -> float:
            return 0.999 * ldp_l1_bound(privacy.clip_delta, privacy.noise_lambda, size, PER_CHECK) / max(size, 1)

        model_level, rows_level = level(model_size), level(np.asarray(rows).size)
        return [*(np.full(np.shape(g), model_level, np.float32) for g in grads), ids,
                np.full(np.shape(rows), rows_level, np.float32)]
    elif kind == "flip-at-bound":
        def push(a):
            return (-np.sign(a) * 0.99 * bound).astype(np.float32)
    elif kind == "flip":
        def push(a):
            return -a
    elif kind == "scaled":
        def push(a):
            return a * np.float32(100.0)
    else:
        raise ValueError(f"unknown attack {kind!r}; expected one of {ATTACKS}")
    return [*(push(np.asarray(g)) for g in grads), ids, push(rows)]


def poisoned_users(num_users: int, fraction: float, seed: int) -> set[int]:
    """A seeded set of round(fraction x users) attackers."""
    rng = np.random.default_rng([seed, 4243])
    return set(rng.choice(num_users, size=int(round(fraction * num_users)), replace=False).tolist())


def run_case(cfg, kind: str | None, fraction: float) -> dict:
    """One run: its final RMSE, how many uploads were poisoned and how many the server rejected."""
    num_users = UserPartitions(prepare_partitions(cfg.data)).meta.num_users
    bad = set() if kind is None else poisoned_users(num_users, fraction, cfg.seed)

    sent = []

    def tamper(user: int, rnd: int, upload: list[np.ndarray]) -> list[np.ndarray]:
        if user not in bad:
            return upload
        sent.append((user, rnd))
        coords = sum(np.asarray(a).size for i, a in enumerate(upload) if i != len(upload) - 2)
        # the server's
        bound = ldp_coordinate_bound(cfg.privacy.clip_delta, cfg.privacy.noise_lambda, coords, PER_CHECK)
        return attack(kind, upload, bound, cfg.privacy)

    out = run_in_process(cfg, log_every=0, tamper=None if kind is None else tamper)
    out["poisoned_uploads"] = len(sent)
    return {"rmse": out["rmse"], "rejected": out["rejected"], "poisoned_uploads": out["poisoned_uploads"],
            "eval_rejected": out["eval_rejected"], "eval_ratings": out["eval_ratings"],
            "test_ratings": out["test_ratings"], "wall_seconds": round(out["wall_seconds"], 1)}


def main(argv: list[str] | None = None) -> None:
    """Run the clean and poisoned cases for each merge and print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="quickstart")
    ap.add_argument("--dataset", default="")
    add_data_dir(ap)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.05, 0.1, 0.2])
    ap.add_argument("--attacks", nargs="+", default=["coordinated-at-bound", "strongest-passing"], choices=ATTACKS)
    ap.add_argument("--merges", nargs="+", default=["mean", "median", "trimmed"])
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--out", default="benchmarks/results/poisoning.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with input_errors_exit():
        for merge in args.merges:
            cfg = load_config(args.preset, args.dataset or None, [
                f"data.data_dir={args.data_dir}", f"federation.rounds={args.rounds}",
                f"federation.eval_every={args.rounds}", f"merge.robust={merge}", *parse_overrides(" ".join(args.set))])
            cases = [(None, 0.0)] + [(k, f) for k in args.attacks for f in args.fractions]
            for kind, fraction in cases:
                t0 = time.time()
                res = run_case(cfg, kind, fraction)
                rows.append({"merge": merge, "attack": kind or "none", "fraction": fraction, **res})
                print(f"[poisoning] merge={merge} attack={kind or 'none'} fraction={fraction:.0%} "
                      f"rmse={res['rmse']:.4f} poisoned={res['poisoned_uploads']} rejected={res['rejected']} "
                      f"scored={res['eval_ratings']}/{res['test_ratings']} "
                      f"({time.time() - t0:.0f}s)", flush=True)
    clean = {r["merge"]: r["rmse"] for r in rows if r["attack"] == "none"}
    for r in rows:
        r["vs_clean"] = r["rmse"] - clean[r["merge"]]
    doc = {"command": " ".join(["python -m benchmarks.poisoning", *(sys.argv[1:] if argv is None else argv)]).strip(),
           "date": str(date.today()),
           "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread", "preset": args.preset,
           "rounds": args.rounds, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(markdown_table(["merge", "attack", "poisoned users", "poisoned uploads", "rejected", "test ratings scored",
                          "RMSE", "vs clean"],
                         [[r["merge"], r["attack"], f"{r['fraction']:.0%}", r["poisoned_uploads"], r["rejected"],
                           f"{r['eval_ratings']}/{r['test_ratings']}", r["rmse"], f"{r['vs_clean']:+.4f}"]
                          for r in rows]))


if __name__ == "__main__":
    main()
