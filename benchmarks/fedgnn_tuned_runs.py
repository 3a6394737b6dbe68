"""The headline runs of `fedgnn_tuned` and `fedgnn_features`, in-process, added to
benchmarks/results/<preset>.json.

    python -m benchmarks.fedgnn_tuned_runs --data-dir DATA --dataset ml-100k [--seeds 0 1 2] [--set KEY=VALUE ...]
    python -m benchmarks.fedgnn_tuned_runs --data-dir DATA --dataset ml-100k --preset fedgnn_features --seeds 0 1 \
        --outputs OUT

One run per seed of the preset as it is (its per-dataset schedule, popularity-matched pseudo items, the
paper's LDP) through `fedrec_flwr.cli.inprocess`: the round core and device code of `flwr run`, which gives the
same numbers (BENCHMARKS.md, first run). Each run keeps its final metrics, its RMSE curve, its accounted
budget and its wall time; with `--outputs DIR` each run also writes its results.json and rounds.csv to
DIR/<preset>-<dataset>-s<seed>, the folders `fedrec plot` draws the curves from. Resumable: a (dataset, seed,
sampler, overrides) already in the file is skipped, the file is saved after each run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import add_data_dir, add_resume, in_process_record, results_file
from fedrec_flwr.cli.sweep import finished
from fedrec_flwr.config import load_config
from fedrec_flwr.fsutil import atomic_write

PRESETS = ("fedgnn_tuned", "fedgnn_features")


def run(preset: str, dataset: str, seed: int, data_dir: str, extra: list[str], outputs: Path | None = None) -> dict:
    """One in-process run of `preset`: the record the results page reads (and, with `outputs`, the run's folder
    there for `fedrec plot`)."""
    folder = [f"output_dir={outputs / f'{preset}-{dataset}-s{seed}'}"] if outputs else []
    cfg = load_config(preset, dataset, [f"data.data_dir={data_dir}", f"seed={seed}", *extra, *folder])
    return {"preset": preset, "dataset": dataset, "seed": seed, "privacy": cfg.privacy.ldp, "extra": extra,
            **in_process_record(cfg, record=outputs is not None),
            "command": f"python -m benchmarks.fedgnn_tuned_runs --data-dir DATA --dataset {dataset} --seeds {seed}"
                       + (f" --preset {preset}" if preset != "fedgnn_tuned" else "")
                       + (" --set " + " ".join(extra) if extra else ""),
            "via": "in-process"}


def main() -> None:
    """Run the seeds not yet in the file."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--set", nargs="*", default=[], dest="extra", help="further config overrides of every run")
    ap.add_argument("--preset", choices=PRESETS, default="fedgnn_tuned")
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/<preset>.json")
    ap.add_argument("--outputs", type=Path, default=None,
                    help="also write each run's results.json and rounds.csv to OUTPUTS/<preset>-<dataset>-s<seed>")
    add_resume(ap)
    args = ap.parse_args()
    out = results_file(args.out or Path(f"benchmarks/results/{args.preset}.json"), args.resume)
    doc = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    sampler = load_config(args.preset, args.dataset, args.extra).privacy.pseudo_sampler
    for seed in args.seeds:
        key = {"dataset": args.dataset, "seed": seed, "sampler": sampler, "extra": args.extra}
        if finished(doc, key):
            continue
        print(f"[fedgnn_tuned_runs] {args.dataset} seed {seed} ...", flush=True)
        doc["runs"].append(run(args.preset, args.dataset, seed, args.data_dir, args.extra, args.outputs))
        r = doc["runs"][-1]
        print(f"[fedgnn_tuned_runs] {args.dataset} seed {seed}: RMSE {r['final']['rmse']:.4f} "
              f"({r['wall_seconds']:.0f}s)",
              flush=True)
        atomic_write(out, json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
