"""benchmarks/expansion_probes.py's tables, which BENCHMARKS.md's expansion conclusion is read from: every cell is
compared with `none` and `fixed` of its own seed, never another seed's, and the interval is over the paired seeds."""

from __future__ import annotations

import statistics

from scipy import stats

from benchmarks.expansion_probes import TAIL_ROUNDS, per_seed_table

ROUNDS = 200


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


def test_cells_are_paired_with_the_same_seed_and_unpaired_seeds_left_blank():
    none = {0: 0.92, 1: 0.93, 2: 0.91}
    fixed = {0: 0.918, 1: 0.935, 2: 0.909}
    runs = [_run("none", s, v) for s, v in none.items()]
    runs += [_run("fixed", s, v, without=0.002) for s, v in fixed.items()]
    runs += [_run("fixed-n1", 0, 0.925, without=0.0005), _run("fixed-n1", 7, 0.90)]  # seed 7 has no none nor fixed
    text = per_seed_table({"rounds": ROUNDS, "runs": runs})

    assert _row(text, "fixed", 1) == ["+0.0050", "+0.0050", "", "", "+0.0020"]
    assert _row(text, "fixed-n1", 0) == ["+0.0050", "+0.0050", "+0.0070", "+0.0070", "+0.0005"]
    assert _row(text, "fixed-n1", 7) == ["", "", "", "", ""]

    diffs = [fixed[s] - none[s] for s in none]
    half = stats.t.ppf(0.975, 2) * statistics.stdev(diffs) / 3 ** 0.5
    mean = statistics.mean(diffs)
    assert f"fixed - none, tail, 3 seeds: {mean:+.4f} (95% t interval {mean - half:+.4f} ... {mean + half:+.4f})" in text
    assert "fixed-n1 - none" not in text  # one paired seed gives no interval
    assert f"none's seed spread (std): {statistics.stdev(none.values()):.4f} final" in text
