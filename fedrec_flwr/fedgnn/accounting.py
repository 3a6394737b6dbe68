"""What FedGNN's LDP actually guarantees: per coordinate, per upload and per user over a run.

Mechanism: every coordinate x of an upload is clipped to [-delta, delta] and gets Laplace(lambda)
noise. Neighbouring relation: two devices that differ in any of one user's ratings (user-level;
one changed rating is a special case). Any change of the user's data moves each clipped coordinate
by at most 2 delta, so each coordinate is a Laplace mechanism with L1 sensitivity 2 delta:
- per coordinate of one upload: epsilon = 2 delta / lambda (pure DP; the paper's figure);
- per upload of C coordinates: all C may change together, so one upload composes C such mechanisms;
- per user over a run: a user that uploads k times composes k C mechanisms.
"Basic" is the sum of the epsilons (pure DP). "Tight" is the Renyi-DP accountant of the
`dp-accounting` library over the same Laplace mechanisms, converted to (epsilon, delta)-DP at the
stated delta (or the basic sum where that is smaller). Neither counts the anonymity set itself (the item ids a user registers are sent in
the clear) or the number of uploads, which the server sees.
"""

from __future__ import annotations

from functools import lru_cache

import dp_accounting
import numpy as np
from dp_accounting import rdp


def epsilon_per_coordinate(clip_delta: float, noise_lambda: float) -> float:
    """Pure-DP epsilon of one clipped, Laplace-noised coordinate: sensitivity 2 delta over scale lambda."""
    return 2.0 * clip_delta / noise_lambda


@lru_cache(maxsize=256)
def tight_epsilon(clip_delta: float, noise_lambda: float, mechanisms: int, delta: float) -> float:
    """(epsilon, delta)-DP of `mechanisms` composed coordinate mechanisms: dp-accounting's RDP bound, or the
    basic (pure) sum where that is smaller (a few mechanisms: RDP's conversion to delta costs more there)."""
    if mechanisms <= 0:
        return 0.0
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.LaplaceDpEvent(noise_lambda / (2.0 * clip_delta)), mechanisms)
    accountant = rdp.RdpAccountant()
    accountant.compose(event)
    return min(float(accountant.get_epsilon(delta)), mechanisms * epsilon_per_coordinate(clip_delta, noise_lambda))


def budget(clip_delta: float, noise_lambda: float, coordinates: np.ndarray, uploads: np.ndarray, delta: float) -> dict:
    """The accounted budget of a run: per coordinate, per upload and per user (max and median).

    `coordinates[u]` is how many values user u's upload carries; `uploads[u]` how often it uploaded.
    """
    eps = epsilon_per_coordinate(clip_delta, noise_lambda)
    coordinates = np.asarray(coordinates, np.int64)
    uploads = np.asarray(uploads, np.int64)
    per_run = coordinates * uploads
    order = np.argsort(per_run, kind="stable")
    median_user, max_user = order[(len(order) - 1) // 2], order[-1]
    upload_c = int(coordinates.max()) if coordinates.size else 0

    def run_of(u: int) -> dict:
        m = int(per_run[u])
        return {"uploads": int(uploads[u]), "basic": eps * m, "tight": tight_epsilon(clip_delta, noise_lambda, m, delta)}

    return {
        "neighbouring": "user-level: any change to one user's ratings",
        "delta": delta,
        "epsilon_per_coordinate_per_upload": eps,
        "per_upload": {"coordinates": upload_c, "basic": eps * upload_c,
                       "tight": tight_epsilon(clip_delta, noise_lambda, upload_c, delta)},
        "per_user_run": {"max": run_of(int(max_user)), "median": run_of(int(median_user))},
    }
