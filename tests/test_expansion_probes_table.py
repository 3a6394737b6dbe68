"""`python -m benchmarks.expansion_probes --table`, which BENCHMARKS.md's expansion conclusion is read from, run as a
user runs it on a results file: every cell is compared with `none` and `fixed` of its own seed, never another seed's,
over the tail (the evaluations of the last 100 rounds), and the interval is over the paired seeds."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
ROUNDS, TAIL_ROUNDS = 200, 100


def _run(variant: str, seed: int, level: float, without: float | None = None) -> dict:
    curve = {str(r): level + (0.01 if r < ROUNDS - TAIL_ROUNDS else 0.0) for r in range(20, ROUNDS + 1, 20)}
    run = {"variant": variant, "seed": seed, "final": {"rmse": level}, "rmse_by_round": curve}
    if without is not None:
        run["probes"] = {"rmse_without_neighbours": {k: v + without for k, v in curve.items()}}
    return run


def _row(text: str, variant: str, seed: int) -> list[str]:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:2] == [variant, str(seed)]:
            return cells[2:]
    raise AssertionError(f"no row for {variant} seed {seed}")


def test_cells_are_paired_with_the_same_seed_and_unpaired_seeds_left_blank(tmp_path):
    none = {0: 0.92, 1: 0.93, 2: 0.91}
    fixed = {0: 0.918, 1: 0.935, 2: 0.909}
    runs = [_run("none", s, v) for s, v in none.items()]
    runs += [_run("fixed", s, v, without=0.002) for s, v in fixed.items()]
    runs += [_run("fixed-n1", 0, 0.925, without=0.0005), _run("fixed-n1", 7, 0.90)]  # seed 7 has no none nor fixed
    for r in runs:
        r["wall_seconds"] = 1.0
    path = tmp_path / "expansion_probes-synthetic.json"
    path.write_text(json.dumps({"dataset": "synthetic", "rounds": ROUNDS, "runs": runs}))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.expansion_probes", "--table", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout.split("| variant | seed |", 1)[1]  # the per-seed table and what follows it

    assert _row(text, "fixed", 1) == ["+0.0050", "+0.0050", "", "", "+0.0020"]
    assert _row(text, "fixed-n1", 0) == ["+0.0050", "+0.0050", "+0.0070", "+0.0070", "+0.0005"]
    assert _row(text, "fixed-n1", 7) == ["", "", "", "", ""]

    diffs = [fixed[s] - none[s] for s in none]
    half = stats.t.ppf(0.975, 2) * statistics.stdev(diffs) / 3 ** 0.5
    mean = statistics.mean(diffs)
    assert (f"fixed - none, tail, 3 seeds: {mean:+.4f} (95% t interval {mean - half:+.4f} ... {mean + half:+.4f})"
            in text)
    assert "fixed-n1 - none" not in text  # one paired seed gives no interval
    assert f"none's seed spread (std): {statistics.stdev(none.values()):.4f} final" in text
