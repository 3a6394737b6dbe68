"""FedGNN round time through `flwr run` against the compute floor and Flower's own round, by users per node.

    python -m benchmarks.compute_floor --data-dir DATA [--dataset ml-100k] [--preset fedgnn_tuned]
        [--users-per-node 1 8 32 128] [--rounds 6]

The floor is the same users' work for one round in one process, with no Flower: the in-process runner
(`fedrec_flwr.cli.inprocess`, the same user code and round core) on one core, with the round's users batched
(`simulation.user_batch`, as the preset sets it) and, for comparison, one user at a time. Then, for each
`simulation.users_per_node` U, a FedGNN `flwr run` on ceil(users / U) virtual SuperNodes (U = 0, the default:
one per core, `federation_size.auto_nodes`) and the
`trivial` job (clients echo 16 floats) on as many SuperNodes, sampling min(128, nodes) of them per
round: Flower's own cost of a round at that node count. Median seconds per training round over rounds
2.. (round 1 starts the actors). Writes benchmarks/results/compute_floor.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch

from benchmarks.common import add_data_dir, fedrec_run
from benchmarks.fedgnn_overhead import median_round_seconds
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.flower.federation_size import auto_nodes
from fedrec_flwr.reporting.results import load_results


def main() -> None:
    """Measure the floor once, then both flwr jobs per users-per-node setting; write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--dataset", default="ml-100k")
    ap.add_argument("--preset", default="fedgnn_tuned")
    ap.add_argument("--users-per-node", nargs="+", type=int, default=[1, 8, 32, 128],
                    help="0: the default sizing (one SuperNode per core, the users spread over them)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results/compute_floor.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = [f"data.data_dir={args.data_dir}", f"federation.rounds={args.rounds}",
            f"federation.eval_every={args.rounds}"]
    cfg = load_config(args.preset, args.dataset, base)
    users = UserPartitions(prepare_partitions(cfg.data)).meta.num_users
    floor = run_in_process(cfg, log_every=0)
    floor_s = statistics.median(h["round_seconds"] for h in floor["history"][1:])
    alone = run_in_process(load_config(args.preset, args.dataset, [*base, "simulation.user_batch=1"]), log_every=0)
    alone_s = statistics.median(h["round_seconds"] for h in alone["history"][1:])
    print(f"[compute_floor] floor (one process, no Flower): {floor_s:.2f} s/round batched "
          f"({cfg.simulation.user_batch} users), {alone_s:.2f} s/round one user at a time", flush=True)
    rows = []
    for per_node in args.users_per_node:
        nodes = auto_nodes(users, cfg.simulation) if per_node == 0 else math.ceil(users / per_node)
        with tempfile.TemporaryDirectory() as tmp:
            common = ["--dataset", args.dataset, "--data-dir", args.data_dir]
            fedrec_run(["--preset", args.preset, *common, "--out", f"{tmp}/fedgnn", "--set", *base,
                      f"simulation.users_per_node={per_node}"])
            fedrec_run(["--preset", "trivial", *common, "--out", f"{tmp}/trivial", "--set",
                        f"federation.rounds={args.rounds}",
                      f"simulation.users_per_node={per_node}", f"federation.clients_per_round={min(128, nodes)}"])
            fed, triv = load_results(f"{tmp}/fedgnn"), load_results(f"{tmp}/trivial")
        row = {"users_per_node": per_node, "supernodes": nodes, "fedgnn_round_s": median_round_seconds(fed),
               "trivial_round_s": median_round_seconds(triv), "floor_round_s": floor_s,
               "final_rmse": fed["final"]["rmse"]}
        row["fedgnn_over_floor"] = row["fedgnn_round_s"] / floor_s
        rows.append(row)
        print(f"[compute_floor] {json.dumps(row)}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"date": date.today().isoformat(), "dataset": args.dataset,
                                              "preset": args.preset, "rounds": args.rounds, "users": users,
                                              "clients_per_round": cfg.federation.clients_per_round,
                                              "user_batch": cfg.simulation.user_batch, "floor_rmse": floor["rmse"],
                                              "floor_one_at_a_time_s": alone_s,
                                              "floor_one_at_a_time_rmse": alone["rmse"], "rows": rows}, indent=1))
    print("| users per node | SuperNodes | FedGNN round (s) | trivial round (s) | floor (s) | FedGNN / floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['users_per_node']} | {r['supernodes']} | {r['fedgnn_round_s']:.2f} | {r['trivial_round_s']:.2f} | "
              f"{r['floor_round_s']:.2f} | {r['fedgnn_over_floor']:.2f} |")


if __name__ == "__main__":
    main()
