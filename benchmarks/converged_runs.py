"""FedGNN at convergence: the number of rounds chosen on a validation holdout, then test runs on three seeds.

    python -m benchmarks.converged_runs --data-dir DATA --dataset ml-100k --max-rounds 800
    python -m benchmarks.converged_runs --data-dir DATA --dataset douban --max-rounds 400
    python -m benchmarks.converged_runs --plot benchmarks/results/converged-*.json
    python -m benchmarks.converged_runs --table benchmarks/results/converged-*.json

1. Validation: one run of the preset (seed `--validation-seed`) with `data.holdout=validation` (a per-user
   10% of the training ratings held out of training, `fedrec_flwr.data.holdout`), `--max-rounds` long, its
   RMSE on the held-out ratings every `--eval-every` rounds. The test ratings are not read.
2. The number of rounds R: the first evaluation at which the validation RMSE's 5-evaluation trailing mean fell by
   less than 0.001 over the last 10% of the rounds (`fedrec_flwr.reporting.convergence.rounds_to_flatten`); the
   whole run if it never flattened (then the record says so).
3. Test: one run per seed on the full training ratings, R rounds, scored on every test rating; its
   accounted privacy budget is that of R rounds.

In-process (the round core and device code of `flwr run`), one torch thread per process, so two datasets
can run side by side on two cores (or one dataset's test seeds, split by `--seeds`). Resumable: each finished phase is
saved to benchmarks/results/converged-<preset>-<dataset>.json and skipped on a rerun with the same settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common import add_data_dir, add_resume, in_process_record, results_file
from fedrec_flwr.config import load_config
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.reporting.convergence import FLATTEN_SMOOTHING, FLATTEN_TOLERANCE, FLATTEN_WINDOW, rounds_to_flatten


def one_run(preset: str, dataset: str, seed: int, data_dir: str, overrides: list[str]) -> dict:
    """One in-process run; its curve, final metrics, budget and time."""
    cfg = load_config(preset, dataset, [f"data.data_dir={data_dir}", f"seed={seed}", *overrides])
    return {"seed": seed, "holdout": cfg.data.holdout, "rounds": cfg.federation.rounds, "overrides": overrides,
            **in_process_record(cfg, log_every=1)}


def plot(files: list[Path], path: Path) -> None:
    """One panel per dataset: the validation curve, each seed's test curve, the chosen round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(f.read_text()) for f in files]
    fig, axes = plt.subplots(1, len(docs), figsize=(5.5 * len(docs), 4), squeeze=False)
    for ax, doc in zip(axes[0], docs):
        for r in doc["runs"]:
            pts = sorted((int(k), v) for k, v in r["rmse_by_round"].items())
            style = {"ls": "--", "color": "black",
                     "label": f"validation (seed {r['seed']})"} if r["holdout"] == "validation" \
                else {"label": f"test, seed {r['seed']}"}
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=2, **style)
        if "chosen_rounds" in doc:
            ax.axvline(doc["chosen_rounds"], color="grey", lw=0.8)
        ax.set_title(f"{doc['preset']} on {doc['dataset']}: rounds chosen on validation")
        ax.set_xlabel("training round")
        ax.set_ylabel("RMSE")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(files: list[Path]) -> str:
    """Markdown: per dataset, the validation curve and each seed's test curve at up to 8 rounds, the chosen
    round, and the test runs' mean +- std with the median user's accounted budget."""
    lines = []
    for doc in (json.loads(f.read_text()) for f in files):
        chosen = doc.get("chosen_rounds")
        val = [r for r in doc["runs"] if r["holdout"] == "validation"]
        tests = sorted((r for r in doc["runs"] if r["holdout"] == "test" and r["rounds"] == chosen),
                       key=lambda r: r["seed"])
        longest = max(int(k) for r in doc["runs"] for k in r["rmse_by_round"])
        # at most about 8 columns, on the evaluation grid, the chosen round among them
        step = -(-longest // 8 // 20) * 20
        cols = sorted({*range(longest, 0, -step), *([chosen] if chosen else [])})
        lines += [f"| {doc['dataset']} | " + " | ".join(f"@{c}" for c in cols) + " | wall (s) |",
                  "|---|" + "---|" * (len(cols) + 1)]
        for r in val + tests:
            cells = [r["rmse_by_round"].get(str(c)) for c in cols]
            label = f"validation, seed {r['seed']}" if r["holdout"] == "validation" else f"test, seed {r['seed']}"
            lines.append(f"| {label} | " + " | ".join("" if v is None else f"{v:.4f}" for v in cells)
                         + f" | {r['wall_seconds']:.0f} |")
        if tests:
            finals = [r["final"]["rmse"] for r in tests]
            spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
            median = tests[0]["budget"]["per_user_run"]["median"]
            lines.append(f"\nChosen: {chosen} rounds; test RMSE {statistics.mean(finals):.4f} ± {spread:.4f} "
                         f"({len(finals)} seeds: {', '.join(f'{v:.4f}' for v in finals)}); the median user of seed "
                         f"{tests[0]['seed']} spent {median['tight']:.3g} over its {median['uploads']} uploads "
                         f"(RDP, δ = 1e-5).\n")
    return "\n".join(lines)


def main() -> None:
    """Run whichever phase is not in the results file yet."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--dataset")
    ap.add_argument("--preset", default="fedgnn_tuned")
    ap.add_argument("--max-rounds", type=int, help="length of the validation run")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--validation-seed", type=int, default=0)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the test runs")
    ap.add_argument("--set", nargs="*", default=[], dest="extra", help="further config overrides of every run")
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    add_resume(ap)
    ap.add_argument("--plot", type=Path, nargs="+", metavar="JSON",
                    help="only draw these results files into OUT_DIR/converged_rmse.png")
    ap.add_argument("--table", type=Path, nargs="+", metavar="JSON", help="only print these results files as markdown")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    if args.plot:
        plot(args.plot, args.out_dir / "converged_rmse.png")
        return
    if not args.dataset or not args.max_rounds or args.max_rounds < (FLATTEN_SMOOTHING + 2) * args.eval_every:
        ap.error(f"--dataset and --max-rounds (at least {FLATTEN_SMOOTHING + 2} evaluation intervals, what the flatten "
                 "rule reads) are needed, unless --plot or --table")
    out = results_file(args.out_dir / f"converged-{args.preset}-{args.dataset}.json", args.resume)
    doc = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    doc.update(preset=args.preset, dataset=args.dataset, rule={"tolerance": FLATTEN_TOLERANCE, "window": FLATTEN_WINDOW,
                                                           "smoothing": FLATTEN_SMOOTHING},
               command=f"python -m benchmarks.converged_runs --data-dir DATA --dataset {args.dataset} --max-rounds "
                       f"{args.max_rounds}" + (f" --preset {args.preset}" if args.preset != "fedgnn_tuned" else "")
                       + (" --set " + " ".join(args.extra) if args.extra else ""))
    schedule = [f"federation.eval_every={args.eval_every}", *args.extra]

    def run_once(seed: int, overrides: list[str]) -> dict:
        done = next((r for r in doc["runs"] if r["seed"] == seed and r["overrides"] == overrides), None)
        if done is not None:
            return done
        print(f"[converged_runs] {args.dataset} seed {seed}: {' '.join(overrides)}", flush=True)
        record = one_run(args.preset, args.dataset, seed, args.data_dir, overrides)
        if out.is_file():  # another process may have added a seed meanwhile (`--seeds` split over two cores)
            doc["runs"] = json.loads(out.read_text())["runs"]
        doc["runs"].append(record)
        atomic_write(out, json.dumps(doc, indent=1))
        return record

    val = run_once(args.validation_seed, ["data.holdout=validation", f"federation.rounds={args.max_rounds}", *schedule])
    chosen, flat = rounds_to_flatten({int(r): v for r, v in val["rmse_by_round"].items()})
    doc["chosen_rounds"], doc["flattened"] = chosen, flat
    atomic_write(out, json.dumps(doc, indent=1))
    print(f"[converged_runs] {args.dataset}: {chosen} rounds ({'flattened' if flat else 'NOT flattened'}; "
          f"validation RMSE {val['rmse_by_round'][str(chosen)]:.4f})", flush=True)
    for seed in args.seeds:
        r = run_once(seed, ["data.holdout=test", f"federation.rounds={chosen}", *schedule])
        print(f"[converged_runs] {args.dataset} seed {seed}: test RMSE {r['final']['rmse']:.4f} after {chosen} rounds",
              flush=True)


if __name__ == "__main__":
    main()
