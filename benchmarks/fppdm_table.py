"""FPPDM / FPPDM++ against single-domain and FedAvg-LightGCN baselines, through `flwr run`.

    python -m benchmarks.fppdm_table --data-dir ../shared/data \
        --datasets douban-book-music amazon-phone-elec amazon-cloth-sport --seeds 0 1 2

Every (dataset, preset, seed) is one `fedrec run --preset P --dataset D` job (one
SuperNode per domain). The script holds no training settings: each dataset's schedule and
training settings live in the dataset's settings files (conf/datasets/families/<family>.yaml, then
conf/datasets/<dataset>.yaml; section `algorithms.fppdm`), which the
config loader applies to all four presets alike, so rows differ only in the algorithm. Finished
jobs are kept in the JSON and skipped on a rerun, so an interrupted sweep continues where it
stopped. Writes benchmarks/results/fppdm_table.json and prints the markdown table (mean +- std
over seeds of the mean over domains).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.common import add_data_dir, add_resume, results_file
from fedrec_flwr.cli.sweep import load_sweep, run_missing
from fedrec_flwr.config import CONF_DIR, dataset_conf_paths

PRESETS = ("single_domain", "fedavg_lightgcn", "fppdm", "fppdm_pp")

# The paper's K per dataset (Douban 5, Amazon 10); K = 10 is reported everywhere too.
PAPER_K = {"douban-book-music": 5, "amazon-phone-elec": 10, "amazon-cloth-sport": 10}


def settings(dataset: str) -> dict:
    """The settings the dataset's files (its family's, then its own) give every FPPDM preset (recorded in the JSON)."""
    paths = dataset_conf_paths(dataset)
    merged = OmegaConf.create()
    for path in paths:
        merged = OmegaConf.merge(merged, OmegaConf.load(path).get("algorithms", {}).get("fppdm", {}) or {})
    return {"file": ", ".join(str(p.relative_to(CONF_DIR.parent)) for p in paths), **OmegaConf.to_container(merged)}


def command(dataset: str, preset: str, seed: int, data_dir: str) -> list[str]:
    """The fedrec run arguments of one table cell (also printed in BENCHMARKS.md)."""
    return ["--preset", preset, "--dataset", dataset, "--data-dir", data_dir, "--seed", str(seed)]


def table(doc: dict) -> str:
    """Markdown: one block per dataset, rows = presets, cells = mean +- std over seeds."""
    lines = []
    for dataset in doc["datasets"]:
        k = PAPER_K.get(dataset, 10)
        keys = [f"hr@{k}", f"ndcg@{k}"] + ([] if k == 10 else ["hr@10", "ndcg@10"])
        lines += [f"\n**{dataset}**\n", "| preset | seeds | " + " | ".join(keys) + " | wall s (median) |",
                  "|---|---|" + "---|" * len(keys) + "---|"]
        for preset in PRESETS:
            runs = [r for r in doc["runs"] if r["dataset"] == dataset and r["preset"] == preset]
            if not runs:
                continue
            cells = []
            for key in keys:
                vals = [r["final"][key] for r in runs]
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                cells.append(f"{statistics.mean(vals):.4f} ± {sd:.4f}")
            wall = statistics.median(r["wall_seconds"] for r in runs)
            lines.append(f"| {preset} | {len(runs)} | " + " | ".join(cells) + f" | {wall:.0f} |")
    return "\n".join(lines)


def main() -> None:
    """Run every missing cell, save after each, print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=list(PAPER_K))
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", default="benchmarks/results/fppdm_table.json")
    add_resume(ap)
    args = ap.parse_args()
    out = results_file(Path(args.out), args.resume)
    doc = load_sweep(out, args.datasets, {d: settings(d) for d in args.datasets})
    cells = [({"dataset": d, "preset": p, "seed": s}, command(d, p, s, args.data_dir))
             for d in args.datasets for s in args.seeds for p in args.presets]
    run_missing(doc, out, cells, "fppdm_table")
    print(table(doc))


if __name__ == "__main__":
    main()
