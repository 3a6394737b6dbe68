"""Local differential privacy for uploads: L-infinity clipping then Laplace noise.

Clipping every coordinate to [-delta, delta] bounds the L-inf sensitivity of one
coordinate by 2*delta; Laplace(0, lambda) noise then gives epsilon = 2*delta/lambda
per coordinate per upload (FedGNN, Eq. 6); fedrec_flwr.fedgnn.accounting composes it over an
upload and a run.
"""

from __future__ import annotations

import numpy as np


def clip_linf(x: np.ndarray, delta: float) -> np.ndarray:
    """Every coordinate clamped into [-delta, delta]."""
    return np.clip(x, -delta, delta)


def laplace(rng: np.random.Generator, scale: float, shape: tuple[int, ...]) -> np.ndarray:
    """Laplace(0, scale) samples in float32, as the difference of two Exp(1) draws times scale.

    Same law as numpy's `rng.laplace`, always finite, and about 3x faster at float32.
    """
    e = rng.standard_exponential((2, *shape), dtype=np.float32)
    return np.float32(scale) * (e[0] - e[1])


def privatize(arrays: list[np.ndarray], delta: float, noise_lambda: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Clip each array to the L-inf ball of radius delta and add i.i.d. Laplace(0, lambda) noise."""
    out = []
    for a in arrays:
        clipped = clip_linf(np.asarray(a, np.float32), delta)
        out.append(clipped + laplace(rng, noise_lambda, clipped.shape))
    return out
