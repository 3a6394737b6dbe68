"""When a curve has flattened: the rule that picks a run's number of rounds from its validation curve."""

from __future__ import annotations

FLATTEN_TOLERANCE = 0.001  # RMSE points
FLATTEN_WINDOW = 0.10  # of the rounds run so far
FLATTEN_SMOOTHING = 5  # evaluations in the trailing mean


def rounds_to_flatten(curve: dict[int, float], tolerance: float = FLATTEN_TOLERANCE, window: float = FLATTEN_WINDOW,
                      smoothing: int = FLATTEN_SMOOTHING) -> tuple[int, bool]:
    """The first evaluated round r at which the curve's trailing mean over `smoothing` evaluations fell by less
    than `tolerance` over the last `window` of the rounds (at least two evaluation intervals), and whether
    such a round exists; (last round, False) when the curve never flattened.

    Why the trailing mean: under LDP an evaluation moves by about +-0.002 from one to the next (the noisy
    item rows), as much as a 10% window's real progress late in a run, so a rule on single evaluations
    stops at the first lucky one (on ML-100K's validation curve it stopped at round 440 of a curve still
    falling 0.008 by round 700)."""
    rounds = sorted(curve)
    if len(rounds) < smoothing + 2:
        raise ValueError(f"a curve of {len(rounds)} evaluations; expected at least {smoothing + 2} to tell whether "
                         "it flattened")
    step = min(b - a for a, b in zip(rounds, rounds[1:]))
    mean = {r: sum(curve[q] for q in rounds[i + 1 - smoothing:i + 1]) / smoothing
            for i, r in enumerate(rounds) if i + 1 >= smoothing}
    for r in mean:
        back = r - max(window * r, 2 * step)
        earlier = [q for q in mean if q <= back]
        if earlier and mean[earlier[-1]] - mean[r] < tolerance:
            return r, True
    return rounds[-1], False
