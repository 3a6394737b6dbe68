"""Batched users against one user at a time: FedGNN round time in one process, and the same numbers.

    python -m benchmarks.batched_users --data-dir DATA [--rounds 5] [--repeats 3]

For each case (the `quickstart` preset on the embedded synthetic data, d = 32; `fedgnn_tuned` on
ML-100K, d = 256, skipped when its files are absent; `fedgnn_paper`, GAT d = 256, on 1,000 synthetic
users shaped like ML-10M, whose power-law degrees test the grouping's padding) runs `fedrec_flwr.cli.inprocess` with
`simulation.user_batch` = 1 and = 32, alternating, `repeats` times, on one thread; records the
median training-round seconds of each (rounds after the first), their ratio, and both runs' final
RMSE (equal up to float rounding). Writes benchmarks/results/batched_users.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from datetime import date
from pathlib import Path

import torch

from benchmarks.common import add_data_dir
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config
from fedrec_flwr.data import DataError
from fedrec_flwr.fsutil import atomic_write

ML10M_SHAPE = ("data.synthetic.num_users=1000", "data.synthetic.num_items=10677", "data.synthetic.mean_degree=180")
CASES = [("quickstart", "synthetic", ()), ("fedgnn_tuned", "ml-100k", ()), ("fedgnn_paper", "synthetic", ML10M_SHAPE)]


def _round_seconds(preset: str, dataset: str, data_dir: str, rounds: int, batch: int,
                   extra: tuple[str, ...] = ()) -> tuple[float, float]:
    cfg = load_config(preset, dataset, [f"data.data_dir={data_dir}", f"federation.rounds={rounds}",
                                        f"federation.eval_every={rounds}", f"simulation.user_batch={batch}", *extra])
    out = run_in_process(cfg, log_every=0)
    return statistics.median(h["round_seconds"] for h in out["history"][1:]), out["rmse"]


def main() -> None:
    """Time every case both ways, print a table, write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/batched_users.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for preset, dataset, extra in CASES:
        times: dict[int, list[float]] = {1: [], 32: []}
        rmse: dict[int, float] = {}
        try:
            for _ in range(args.repeats):
                for batch in (1, 32):
                    secs, rmse[batch] = _round_seconds(preset, dataset, args.data_dir, args.rounds, batch, extra)
                    times[batch].append(secs)
        except DataError as exc:
            print(f"[batched_users] {preset} on {dataset} skipped: {exc}", flush=True)
            continue
        one, batched = statistics.median(times[1]), statistics.median(times[32])
        rows.append({"preset": preset, "dataset": dataset, "overrides": list(extra), "one_at_a_time_s": one,
                     "batched_s": batched, "speedup": one / batched, "rmse_one_at_a_time": rmse[1],
                     "rmse_batched": rmse[32], "runs": times})
        print(f"[batched_users] {json.dumps(rows[-1])}", flush=True)
    print("| preset | dataset | one at a time (s/round) | 32 batched (s/round) | speedup | RMSE (one / batched) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['dataset']} | {r['one_at_a_time_s']:.2f} | {r['batched_s']:.2f} | "
              f"{r['speedup']:.1f}x | {r['rmse_one_at_a_time']:.6f} / {r['rmse_batched']:.6f} |")
    record = {"date": date.today().isoformat(),
              "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, 1 thread",
              "command": f"python -m benchmarks.batched_users --rounds {args.rounds} --repeats {args.repeats}",
              "rounds": args.rounds, "repeats": args.repeats, "rows": rows}
    atomic_write(Path(args.out), json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
