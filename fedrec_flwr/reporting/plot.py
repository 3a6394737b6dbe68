"""PNG charts of metric-vs-round and seconds-per-round from one or more results files."""

from __future__ import annotations

from pathlib import Path

from fedrec_flwr.fsutil import writable_folder, writing_into
from fedrec_flwr.reporting.summary import read_results

METRICS = ("rmse", "mae", "hr@5", "ndcg@5", "hr@10", "ndcg@10")


def plot_runs(paths: list[str], out_dir: str) -> list[Path]:
    """One PNG per metric present in any run, plus round time; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(p, read_results(p)) for p in paths]  # every file checked before anything is drawn
    out = writable_folder(out_dir, "plot folder")
    written = []
    for metric in (*METRICS, "round_seconds"):
        series = []
        for p, doc in runs:
            pts = [(r["round"], r[metric]) for r in doc.get("rounds", []) if metric in r and r[metric] is not None]
            if pts:
                series.append((f"{doc['algorithm']}/{doc['dataset']} ({Path(p).name})", pts))
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, pts in series:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=label)
        ax.set_xlabel("round")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        target = out / f"{metric.replace('@', '_at_')}.png"
        with writing_into(out, "plot folder", f"writing {target.name}"):
            fig.savefig(target, dpi=110)
        plt.close(fig)
        written.append(target)
    return written
