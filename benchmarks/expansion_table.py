"""FedGNN graph expansion: GNN type x expansion mode x seed, privacy on, through `flwr run`.

    python -m benchmarks.expansion_table --data-dir ../shared/data --datasets ml-100k douban --seeds 0 1 2
    python -m benchmarks.expansion_table --protocol tuned --data-dir ../shared/data --gnns ggnn --seeds 0

Every (dataset, gnn, mode, seed) cell is one `fedrec run` job with the paper's
privacy settings (M = 1000, delta 0.1, lambda 0.2, 128 users per round) and the same protocol
settings for every cell of a dataset, so rows differ only in the GNN and the expansion mode.
Two protocols: `short` (40 rounds of the paper preset with tuned server settings, `SETTINGS`) and
`tuned` (the `fedgnn_tuned` preset on its first schedule, pinned: 300 rounds on ML-100K, 200 on Douban),
which evaluates every 20 rounds so each cell's curve is recorded. Finished cells are kept in the JSON and
skipped on a rerun, so an interrupted sweep continues where it stopped. Writes
benchmarks/results/expansion_table.json (short) or expansion_converged.json (tuned: its cells predate
the validation-chosen length), and prints the markdown table (mean +- std of the final RMSE over seeds).
Expansion at the validation-chosen length, with its probes, is `benchmarks.expansion_probes` (in-process).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.common import add_data_dir, add_resume, results_file
from fedrec_flwr.cli.sweep import load_sweep, run_missing, run_record

GNNS = ("gat", "gcn", "ggnn")
MODES = ("none", "trainable", "fixed")

# The tuned protocol settings of the FedGNN accuracy runs (BENCHMARKS.md), shortened to fit a
# 2-core budget: several users per virtual SuperNode cut Flower's per-node overhead without
# changing any number (multiplexing is exact, see tests/test_fedgnn_protocol.py). `fixed`
# expands after T epochs: T = 2 (the paper's) on ML-100K is after round 16 of 40; Douban's 3,000 users
# make an epoch 24 rounds, so T = 1 there leaves 16 rounds with neighbours.
_COMMON = ["server_opt.name=adam", "server_opt.lr=0.003", "server_opt.item_lr=0.01", "local.loss=sum",
           "local.user_lr=0.1", "local.user_steps=5", "simulation.users_per_node=8"]
SETTINGS = {
    "ml-100k": [*_COMMON, "federation.rounds=40", "federation.eval_every=40", "expansion.epoch=2"],
    "douban": [*_COMMON, "federation.rounds=40", "federation.eval_every=40", "expansion.epoch=1"],
}


# The tuned protocol is the tuned preset (its schedule and per-dataset files) at its first lengths, those of
# the cells recorded before the lengths were chosen on validation; `fixed` expands after the default T = 2
# epochs (ML-100K round 15, Douban round 47).
FIRST_LENGTHS = {"ml-100k": 300, "douban": 200}
TUNED = {dataset: ["simulation.users_per_node=8", f"federation.rounds={FIRST_LENGTHS[dataset]}"]
         for dataset in SETTINGS}
PROTOCOLS = {
    "short": ("fedgnn_paper", SETTINGS, "benchmarks/results/expansion_table.json"),
    "tuned": ("fedgnn_tuned", TUNED, "benchmarks/results/expansion_converged.json"),
}


def command(dataset: str, gnn: str, mode: str, seed: int, data_dir: str, protocol: str = "short") -> list[str]:
    """The fedrec run arguments of one table cell (also printed in docs/benchmarks/expansion.md)."""
    preset, settings, _ = PROTOCOLS[protocol]
    return ["--preset", preset, "--dataset", dataset, "--data-dir", data_dir, "--seed", str(seed),
            "--set", *settings[dataset], f"model.gnn={gnn}", f"expansion.mode={mode}"]


def table(doc: dict) -> str:
    """Markdown: one block per dataset, rows = GNN, columns = expansion modes (mean +- std over seeds)."""
    lines = []
    for dataset in doc["datasets"]:
        lines += [f"\n**{dataset}** (final RMSE, mean ± std over seeds; seeds per cell in brackets)\n",
                  "| GNN | " + " | ".join(MODES) + " | fixed - none | wall s per run (median) |",
                  "|---|" + "---|" * len(MODES) + "---|---|"]
        for gnn in GNNS:
            runs = {m: [r for r in doc["runs"] if (r["dataset"], r["gnn"], r["mode"]) == (dataset, gnn, m)]
                    for m in MODES}
            if not any(runs.values()):
                continue
            cells, means = [], {}
            for m in MODES:
                vals = [r["final"]["rmse"] for r in runs[m]]
                if not vals:
                    cells.append("-")
                    continue
                means[m] = statistics.mean(vals)
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                cells.append(f"{means[m]:.4f} ± {sd:.4f} [{len(vals)}]")
            diff = f"{means['fixed'] - means['none']:+.4f}" if {"fixed", "none"} <= means.keys() else "-"
            walls = [r["wall_seconds"] for rs in runs.values() for r in rs]
            lines.append(f"| {gnn} | " + " | ".join(cells) + f" | {diff} | {statistics.median(walls):.0f} |")
    return "\n".join(lines)


def main() -> None:
    """Run every missing cell, save after each, print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--gnns", nargs="+", default=list(GNNS), choices=GNNS)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--protocol", default="short", choices=list(PROTOCOLS))
    ap.add_argument("--out", help="default: the protocol's file under benchmarks/results/")
    add_resume(ap)
    args = ap.parse_args()
    preset, settings, default_out = PROTOCOLS[args.protocol]
    out = results_file(Path(args.out or default_out), args.resume)
    doc = load_sweep(out, args.datasets, {"preset": preset, "settings": settings})
    cells = [({"dataset": d, "gnn": g, "mode": m, "seed": s}, command(d, g, m, s, args.data_dir, args.protocol))
             for d in args.datasets for s in args.seeds for g in args.gnns for m in args.modes]
    run_missing(doc, out, cells, "expansion_table", extra=run_record)
    print(table(doc))


if __name__ == "__main__":
    main()
