"""Local differential privacy for uploads: L-infinity clipping then Laplace noise.

Clipping every coordinate to [-delta, delta] bounds the L-inf sensitivity of one
coordinate by 2*delta; Laplace(0, lambda) noise then gives epsilon = 2*delta/lambda
per coordinate per upload (FedGNN, Eq. 6).
"""

from __future__ import annotations

import numpy as np


def epsilon(clip_delta: float, noise_lambda: float) -> float:
    """Per-upload privacy budget of clip-and-Laplace."""
    return 2.0 * clip_delta / noise_lambda


def clip_linf(x: np.ndarray, delta: float) -> np.ndarray:
    """Every coordinate clamped into [-delta, delta]."""
    return np.clip(x, -delta, delta)


def privatize(arrays: list[np.ndarray], delta: float, noise_lambda: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Clip each array to the L-inf ball of radius delta and add i.i.d. Laplace(0, lambda) noise."""
    out = []
    for a in arrays:
        clipped = clip_linf(np.asarray(a, np.float32), delta)
        out.append((clipped + rng.laplace(0.0, noise_lambda, size=clipped.shape)).astype(np.float32))
    return out
