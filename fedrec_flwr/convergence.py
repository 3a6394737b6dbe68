"""When a curve has flattened: the rule that picks a run's number of rounds from its validation curve."""

from __future__ import annotations

import math

FLATTEN_TOLERANCE = 0.001  # RMSE points
FLATTEN_WINDOW = 0.10  # of the rounds run so far


def rounds_to_flatten(curve: dict[int, float], tolerance: float = FLATTEN_TOLERANCE,
                      window: float = FLATTEN_WINDOW) -> tuple[int, bool]:
    """The first evaluated round r at which the best RMSE so far improved by less than `tolerance` over the
    last `window` of the rounds (at least two evaluation intervals, so one noisy evaluation cannot end a
    run early), and whether such a round exists; (last round, False) when the curve never flattened.

    The best-so-far curve is used, not the raw one, so a late evaluation that is worse than an earlier
    one counts as no progress rather than as a rise to wait out."""
    rounds = sorted(curve)
    if len(rounds) < 2:
        raise ValueError(f"a curve of {len(rounds)} evaluations; expected at least 2 to tell whether it flattened")
    step = min(b - a for a, b in zip(rounds, rounds[1:]))
    best, running = {}, math.inf
    for r in rounds:
        running = min(running, curve[r])
        best[r] = running
    for r in rounds:
        back = r - max(window * r, 2 * step)
        earlier = [q for q in rounds if q <= back]
        if earlier and best[earlier[-1]] - best[r] < tolerance:
            return r, True
    return rounds[-1], False
