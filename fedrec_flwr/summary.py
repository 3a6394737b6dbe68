"""The final summary of a run from its results.json (`fedrec run` prints it; `fedrec summary` too)."""

from __future__ import annotations

from .baselines import best_trivial
from .results import load_results

_BASELINE_NAMES = {"global_mean": "global mean", "user_mean": "user mean", "item_mean": "item mean",
                   "bias": "bias (mean + user + item bias)"}


def summarize(path: str) -> str:
    """A short summary: final metrics beside the split's baselines, rounds, wall time, traffic, privacy."""
    doc = load_results(path)
    if doc.get("status") != "finished":  # a failed or unfinished run has no result to show
        return f"{doc['algorithm']} on {doc['dataset']}: {doc.get('status')}: {doc.get('error', 'no final metrics')}"
    rounds = [r for r in doc["rounds"] if r.get("phase") == "train" or "train_loss" in r]
    final = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in doc["final"].items())
    up = [r["bytes_up"] for r in rounds if "bytes_up" in r]
    down = [r["bytes_down"] for r in rounds if "bytes_down" in r]
    lines = [
        f"{doc['algorithm']} on {doc['dataset']} ({doc.get('status')}): {final}",
        f"  training rounds: {len(rounds)}, wall: {doc['wall_seconds']:.1f}s",
    ]
    if doc.get("rounds_not_applied"):
        lines.append(f"  {doc['rounds_not_applied']} of {len(rounds)} training rounds were not applied "
                     "(fewer than min_clients accepted uploads)")
    scored, total = doc["final"].get("eval_ratings"), doc["final"].get("test_ratings")
    if scored is not None and total is not None:
        lines.append(f"  test ratings scored: {scored:,} of the split's {total:,}")
    baselines = doc.get("baselines")
    rmse = doc["final"].get("rmse")
    if baselines:
        on = doc.get("baseline_ratings")
        lines.append("  test RMSE of centralized baselines (no federation, no privacy) on "
                     + (f"the same {on:,} test ratings:" if on is not None else "the same split:"))
        lines += [f"    {_BASELINE_NAMES.get(k, k):32s} {v:.4f}" for k, v in baselines.items()]
        if rmse is not None:
            best = best_trivial(baselines)
            lines.append(f"  model {rmse:.4f} is {100 * (1 - rmse / best):.1f}% below the best trivial baseline ({best:.4f})")
    budget = doc.get("privacy")
    if budget:
        one, run = budget["per_upload"], budget["per_user_run"]
        lines.append(f"  privacy ({budget['neighbouring']}; tight = RDP at delta {budget['delta']:g}):")
        lines.append(f"    epsilon {budget['epsilon_per_coordinate_per_upload']:g} per coordinate of one upload")
        lines.append(f"    one upload ({one['coordinates']:,} coordinates): {one['basic']:.4g} basic, {one['tight']:.4g} tight")
        for which in ("median", "max"):
            r = run[which]
            lines.append(f"    {which} user over the run ({r['uploads']} uploads): {r['basic']:.4g} basic, {r['tight']:.4g} tight")
    if up:
        lines.append(f"  per client per round: {sum(up) / len(up) / 1e6:.3f} MB up, {sum(down) / len(down) / 1e6:.3f} MB down")
    lines.append(f"  results: {path}/results.json")
    return "\n".join(lines)
