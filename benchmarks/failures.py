"""Training with injected client failures against the same run without them, through `flwr run`.

    python -m benchmarks.failures --dataset ml-100k --data-dir ../shared/data --rounds 30

Both jobs use the same seed and settings. The faulty one injects, per sampled node and round
(seeded): crashes (`faults.crash`), stragglers that answer after the round timeout
(`faults.straggle`, `faults.straggle_seconds` > `federation.round_timeout`) and NaN uploads
(`faults.malformed`), which the server must reject. Reports both RMSEs, their difference, and
how many updates failed or were rejected. Writes benchmarks/results/failures.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from datetime import date
from pathlib import Path

from benchmarks.common import add_data_dir, fedrec_run
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.reporting.results import load_results

TUNED = ["server_opt.name=adam", "server_opt.lr=0.003", "local.loss=sum", "local.user_lr=0.1",
         "local.user_steps=5"]
FAULTS = ["faults.crash=0.15", "faults.straggle=0.02", "faults.straggle_seconds=10", "federation.round_timeout=8",
          "faults.malformed=0.05"]


def main() -> None:
    """Run the clean and the faulty job; record the comparison."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="ml-100k")
    add_data_dir(ap)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", nargs="*", default=FAULTS)
    ap.add_argument("--set", nargs="*", default=TUNED)
    ap.add_argument("--out", default="benchmarks/results/failures.json")
    args = ap.parse_args()
    common = [f"federation.rounds={args.rounds}", f"federation.eval_every={args.rounds}", *args.set]
    jobs = {}
    for name, extra in (("clean", []), ("faulty", args.faults)):
        with tempfile.TemporaryDirectory() as tmp:
            fedrec_run(["--preset", "fedgnn_paper", "--dataset", args.dataset, "--data-dir", args.data_dir, "--seed",
                        str(args.seed),
                      "--out", tmp, "--set", *common, *extra])
            doc = load_results(tmp)
        train = [r for r in doc["rounds"] if r.get("phase") == "train"]
        jobs[name] = {
            "rmse": doc["final"]["rmse"], "wall_seconds": doc["wall_seconds"],
            "sampled": sum(r["clients"] + r.get("failures", 0) for r in train),
            "accepted": sum(r["accepted"] for r in train), "failures": sum(r.get("failures", 0) for r in train),
            "rejected_malformed": sum(r["rejected"] - r.get("failures", 0) for r in train),
            "rounds_not_applied": sum(not r.get("applied", True) for r in train),
            "command": f"fedrec run --preset fedgnn_paper --dataset {args.dataset} --data-dir {args.data_dir} "
                       f"--seed {args.seed} --out OUT --set {' '.join([*common, *extra])}",
        }
        print(f"[failures] {name}: {json.dumps(jobs[name])}", flush=True)
    doc = {"date": date.today().isoformat(), "dataset": args.dataset, "rounds": args.rounds, "faults": args.faults,
           "jobs": jobs, "rmse_difference": jobs["faulty"]["rmse"] - jobs["clean"]["rmse"]}
    atomic_write(Path(args.out), json.dumps(doc, indent=1))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
