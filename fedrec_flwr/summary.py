"""Print the final summary of a finished run from its results.json (used after `make run`)."""

from __future__ import annotations

import sys

from .results import load_results


def summarize(path: str) -> str:
    """One-paragraph summary: algorithm, dataset, final metrics, rounds, wall time, traffic."""
    doc = load_results(path)
    rounds = [r for r in doc["rounds"] if r.get("phase") == "train" or "train_loss" in r]
    final = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in doc["final"].items())
    up = [r["bytes_up"] for r in rounds if "bytes_up" in r]
    down = [r["bytes_down"] for r in rounds if "bytes_down" in r]
    lines = [
        f"{doc['algorithm']} on {doc['dataset']} ({doc.get('status')}): {final}",
        f"  training rounds: {len(rounds)}, wall: {doc['wall_seconds']:.1f}s",
    ]
    if up:
        lines.append(f"  per client per round: {sum(up) / len(up) / 1e6:.3f} MB up, {sum(down) / len(down) / 1e6:.3f} MB down")
    lines.append(f"  results: {path}/results.json")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1] if len(sys.argv) > 1 else "outputs/latest"))
