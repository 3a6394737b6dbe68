"""FedGNN round time and peak memory against the number of users, through `flwr run`.

    python -m benchmarks.scale --users 1000 10000 69878 [--nodes 1000] [--rounds 5]

Synthetic data shaped like ML-10M (10,677 items; mean_degree 180 gives 10.1M ratings at 69,878 users, ~144 per user).
Users are multiplexed onto at most `--nodes` virtual SuperNodes (simulation.users_per_node =
ceil(users / nodes)), so Flower's per-node cost stays that of `--nodes` nodes. Each job:
registration of every user, `--rounds` training rounds of 128 users (paper preset, privacy on),
and one evaluation by a fixed 1% sample of users. Peak memory is the machine's used memory
(MemTotal - MemAvailable) sampled every 0.2 s, minus its value before the job. Writes
benchmarks/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

from benchmarks.common import fedrec_run
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.reporting.results import load_results

ML10M_SHAPE = ["data.synthetic.num_items=10677", "data.synthetic.mean_degree=180"]


def used_memory_bytes() -> int:
    """MemTotal - MemAvailable from /proc/meminfo."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


class PeakMemory:
    """Samples used memory in a thread; `peak - baseline` after `stop()`."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.baseline = interval, used_memory_bytes()
        self.peak, self._stop = self.baseline, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, used_memory_bytes())
            time.sleep(self.interval)

    def stop(self) -> int:
        """Stop sampling; bytes above the baseline at the peak."""
        self._stop.set()
        self._thread.join()
        return self.peak - self.baseline


def main() -> None:
    """Run one job per user count and record round time and peak memory."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", nargs="+", type=int, default=[1000, 10000, 69878])
    ap.add_argument("--nodes", type=int, default=1000, help="most virtual SuperNodes per job")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache-dir", default=".cache/fedrec")
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--out", default="benchmarks/results/scale.json")
    args = ap.parse_args()
    rows = []
    for users in args.users:
        per_node = -(-users // args.nodes)
        overrides = [f"data.synthetic.num_users={users}", *ML10M_SHAPE, f"simulation.users_per_node={per_node}",
                     f"federation.rounds={args.rounds}", f"federation.eval_every={args.rounds}",
                     "federation.eval_fraction=0.01", *args.set]
        # build the dataset and partitions outside the measured job (it shows its own progress)
        cfg = load_config("fedgnn_paper", "synthetic", [f"data.cache_dir={args.cache_dir}", *overrides])
        t0 = time.time()
        meta = UserPartitions(prepare_partitions(cfg.data)).meta
        prep = time.time() - t0
        with tempfile.TemporaryDirectory() as tmp:
            mem = PeakMemory()
            t0 = time.time()
            fedrec_run(["--preset", "fedgnn_paper", "--dataset", "synthetic", "--cache-dir", args.cache_dir,
                        "--out", tmp,
                      "--set", *overrides])
            wall = time.time() - t0
            peak = mem.stop()
            doc = load_results(tmp)
        train = [r for r in doc["rounds"] if r.get("phase") == "train"]
        reg = next(r for r in doc["rounds"] if r.get("phase") == "register")
        secs = [r["round_seconds"] for r in train]
        rows.append({
            "users": users, "items": meta.num_items, "train_ratings": meta.num_train, "users_per_node": per_node,
            "supernodes": -(-users // per_node),
            "median_round_s": statistics.median(secs[1:] if len(secs) > 2 else secs), "round_s": secs,
            "registration_s": reg["round_seconds"], "peak_memory_gb": peak / 2**30, "job_wall_s": wall,
            "data_prep_s": prep, "rmse": doc["final"].get("rmse"),
            "bytes_up": statistics.mean(r["bytes_up"] for r in train),
        })
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["median_round_s"]
    for r in rows:
        r["round_time_vs_first"] = r["median_round_s"] / base
    out = Path(args.out)
    atomic_write(out, json.dumps({"date": date.today().isoformat(), "nodes": args.nodes, "rounds": args.rounds,
                                  "overrides": args.set, "rows": rows}, indent=1))
    print("| users | SuperNodes x users each | train ratings | median round (s) | vs first | registration (s) | peak "
          "memory (GB) | job wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['users']:,} | {r['supernodes']} x {r['users_per_node']} | {r['train_ratings']:,} | "
              f"{r['median_round_s']:.2f} | {r['round_time_vs_first']:.2f} | {r['registration_s']:.1f} | "
              f"{r['peak_memory_gb']:.1f} | {r['job_wall_s']:.0f} |")


if __name__ == "__main__":
    main()
