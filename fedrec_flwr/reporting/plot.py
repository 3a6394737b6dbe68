"""PNG charts of metric-vs-round and seconds-per-round from one or more results files.

The RMSE chart also draws the baselines each run recorded (results.json `baselines`: the global mean, user mean,
item mean and bias model of `fedrec_flwr.reference.baselines`) as horizontal reference lines, so a reader sees at
a glance whether the model beats them. They are the run's own numbers, never recomputed here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedrec_flwr.fsutil import writable_folder, writing_into
from fedrec_flwr.reporting.summary import read_results

METRICS = ("rmse", "mae", "hr@5", "ndcg@5", "hr@10", "ndcg@10")
# recorded name -> (legend name, colour, line style): muted, one style each, below the model's curves
BASELINES = {
    "global_mean": ("global mean", "#9e9e9e", ":"),
    "user_mean": ("user mean", "#b59b76", "--"),
    "item_mean": ("item mean", "#7fa3a3", "-."),
    "bias": ("bias model", "#a58aa5", (0, (6, 2, 1, 2, 1, 2))),
}


def recorded_baselines(doc: dict) -> dict[str, float]:
    """The baseline RMSEs a run recorded (empty if none: older runs, FPPDM's ranking runs), known names only.

    A run records one set, not one per evaluation: written at its start on the whole test split and replaced
    when it finishes by the baselines on the test ratings its final evaluation scored (`baseline_ratings`), the
    same ratings as its final RMSE. So the lines are flat, at the final evaluation's values (the whole split's
    for a run still running or failed); earlier evaluations' user sets have no recorded baselines to step to."""
    found = doc.get("baselines")
    if not isinstance(found, dict):
        return {}
    return {k: float(found[k]) for k in BASELINES
            if isinstance(found.get(k), (int, float)) and not isinstance(found.get(k), bool)}


def baseline_lines(runs: list[tuple[str, dict]]) -> tuple[list[tuple[str, str, float]], list[str]]:
    """The RMSE chart's reference lines as (baseline name, legend label, RMSE), and the runs with an RMSE curve
    but no recorded baselines. Runs recording the same values share one split, so each set is drawn once; with
    several distinct sets each label names its runs."""
    splits: dict[tuple[tuple[str, float], ...], list[str]] = {}
    bare = []
    for path, doc in runs:
        values = recorded_baselines(doc)
        if values:
            splits.setdefault(tuple(values.items()), []).append(Path(path).name)
        elif any(r.get("rmse") is not None for r in doc.get("rounds", [])):
            bare.append(path)
    lines = []
    for values, names in splits.items():
        runs_of = f" ({', '.join(names)})" if len(splits) > 1 else ""
        lines += [(k, f"{BASELINES[k][0]} {v:.4f}{runs_of}", v) for k, v in values]
    return lines, bare


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def draw_chart(metric: str, series: list[tuple[str, list]], references: list[tuple[str, str, float]]):
    """One metric's figure: each run's curve of (round, value) points, then the reference lines, muted, beneath."""
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    for label, pts in series:
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=label)
    for name, label, value in references:
        _, colour, style = BASELINES[name]
        ax.axhline(value, color=colour, ls=style, lw=1.2, zorder=1, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_runs(paths: list[str], out_dir: str) -> list[Path]:
    """One PNG per metric present in any run, plus round time; returns the files written. The RMSE chart carries
    the runs' recorded baselines (`baseline_lines`); a run without them gets one line on stderr."""
    runs = [(p, read_results(p)) for p in paths]  # every file checked before anything is drawn
    out = writable_folder(out_dir, "plot folder")
    references, bare = baseline_lines(runs)
    for path in bare:
        print(f"fedrec plot: {path} recorded no baselines; its RMSE curve is drawn alone", file=sys.stderr)
    written = []
    for metric in (*METRICS, "round_seconds"):
        series = []
        for p, doc in runs:
            pts = [(r["round"], r[metric]) for r in doc.get("rounds", []) if metric in r and r[metric] is not None]
            if pts:
                series.append((f"{doc['algorithm']}/{doc['dataset']} ({Path(p).name})", pts))
        if not series:
            continue
        fig = draw_chart(metric, series, references if metric == "rmse" else [])
        target = out / f"{metric.replace('@', '_at_')}.png"
        with writing_into(out, "plot folder", f"writing {target.name}"):
            fig.savefig(target, dpi=110)
        _pyplot().close(fig)
        written.append(target)
    return written
