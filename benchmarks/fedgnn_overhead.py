"""FedGNN round cost against Flower's own overhead, and traffic per client, through `flwr run`.

    python -m benchmarks.fedgnn_overhead --dataset ml-100k --data-dir ../shared/data --rounds 10 [--repeats 1]

Runs, back to back with the same number of SuperNodes and clients per round: the `trivial`
job (clients echo a 16-float vector) and FedGNN with the given overrides. Reports the median
seconds per training round of each, their ratio, and bytes per client per round against a
full item-table broadcast. Writes benchmarks/results/fedgnn_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from datetime import date
from pathlib import Path

from benchmarks.common import add_data_dir, fedrec_run
from fedrec_flwr.config import load_config
from fedrec_flwr.reporting.results import load_results


def median_round_seconds(doc: dict) -> float:
    """Median seconds of a run's training rounds, without round 1 (it starts the actors) when there are more."""
    times = [r["round_seconds"] for r in doc["rounds"] if r.get("phase") == "train" and "round_seconds" in r]
    return statistics.median(times[1:] if len(times) > 2 else times)  # first round spins up actors


def main() -> None:
    """Run both jobs and record the comparison."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="ml-100k")
    add_data_dir(ap)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--out", default="benchmarks/results/fedgnn_overhead.json")
    args = ap.parse_args()
    rows = []
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            common = ["--dataset", args.dataset, "--data-dir", args.data_dir]
            fedrec_run(["--preset", "trivial", *common, "--out", f"{tmp}/trivial", "--set",
                        f"federation.rounds={args.rounds}"])
            fedrec_run(["--preset", "fedgnn_paper", *common, "--out", f"{tmp}/fedgnn", "--set",
                        f"federation.rounds={args.rounds}",
                      f"federation.eval_every={args.rounds}", *args.set])
            triv, fed = load_results(f"{tmp}/trivial"), load_results(f"{tmp}/fedgnn")
        train = [r for r in fed["rounds"] if r.get("phase") == "train"]
        t_triv, t_fed = median_round_seconds(triv), median_round_seconds(fed)
        rows.append({"repeat": rep, "trivial_round_s": t_triv, "fedgnn_round_s": t_fed, "ratio": t_fed / t_triv,
                     "bytes_up": statistics.mean(r["bytes_up"] for r in train),
                     "bytes_down": statistics.mean(r["bytes_down"] for r in train),
                     "fedgnn_wall_s": fed["wall_seconds"], "final": fed["final"]})
        print(json.dumps(rows[-1]), flush=True)
    cfg = load_config("fedgnn_paper", args.dataset, [f"data.data_dir={args.data_dir}", *args.set])
    from fedrec_flwr.data import UserPartitions, prepare_partitions

    meta = UserPartitions(prepare_partitions(cfg.data)).meta
    full_table = meta.num_items * cfg.model.dim * 4
    doc = {"date": date.today().isoformat(), "dataset": args.dataset, "rounds": args.rounds, "overrides": args.set,
           "clients_per_round": cfg.federation.clients_per_round, "supernodes": meta.num_users,
           "full_item_table_bytes": full_table, "runs": rows,
           "ratio_median": statistics.median(r["ratio"] for r in rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("fedgnn_round_s", "trivial_round_s", "bytes_up", "bytes_down")}
    print(f"FedGNN round / trivial round (median of {len(rows)}): {doc['ratio_median']:.2f} "
          f"(medians {med['fedgnn_round_s']:.2f}s / {med['trivial_round_s']:.2f}s); per client per round "
          f"{med['bytes_up'] / 1e6:.3f} MB up, {med['bytes_down'] / 1e6:.3f} MB down; full item table "
          f"{full_table / 1e6:.3f} MB")


if __name__ == "__main__":
    main()
