"""Local differential privacy for uploads: L-infinity clipping then Laplace noise.

Clipping every coordinate to [-delta, delta] bounds the L-inf sensitivity of one
coordinate by 2*delta; Laplace(0, lambda) noise then gives epsilon = 2*delta/lambda
per coordinate per upload (FedGNN, Eq. 6); fedrec_flwr.fedgnn.accounting composes it over an
upload and a run.

The noise is drawn on the CPU from the user's own numpy stream and added where the upload is (CPU or
CUDA), so a run draws the same noise on either device. Exact and at the generator's speed: |L| / lambda
is a float32 standard exponential (numpy's ziggurat) and the sign an independent random bit, one draw
per coordinate (benchmarks/roofline.py measures it against numpy's float64 `laplace`).
"""

from __future__ import annotations

import numpy as np
import torch


def clip_linf(x: np.ndarray, delta: float) -> np.ndarray:
    """Every coordinate clamped into [-delta, delta]."""
    return np.clip(x, -delta, delta)


def standard_laplace(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` float32 Laplace(0, 1) draws: a standard exponential with a random sign bit (the Laplace law is
    exactly that: |L| ~ Exp(1), its sign independent and fair). One exponential and one bit per value,
    half the work of a difference of two exponentials."""
    e = rng.standard_exponential(count, dtype=np.float32)
    bits = np.unpackbits(np.frombuffer(rng.bytes((count + 7) // 8), np.uint8), count=count)
    signs = np.left_shift(bits, 31, dtype=np.uint32)
    np.bitwise_or(e.view(np.uint32), signs, out=e.view(np.uint32))
    return e


def privatize_flat(x: torch.Tensor, delta: float, noise_lambda: float, rng: np.random.Generator) -> torch.Tensor:
    """`x` (1-D, any device) clipped in place to [-delta, delta] plus Laplace(0, lambda) noise from `rng`."""
    noise = torch.from_numpy(standard_laplace(rng, x.numel())).to(x.device)
    return x.clamp_(-delta, delta).add_(noise, alpha=noise_lambda)


def privatize(arrays: list[np.ndarray], delta: float, noise_lambda: float,
              rng: np.random.Generator) -> list[np.ndarray]:
    """Clip each array to the L-inf ball of radius delta and add i.i.d. Laplace(0, lambda) noise (one draw for
    all arrays, in their order: the same numbers as `privatize_flat` on their concatenation)."""
    flat = torch.from_numpy(np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays]) if arrays
                            else np.zeros(0, np.float32))
    out = privatize_flat(flat, delta, noise_lambda, rng).numpy()
    sizes = np.cumsum([np.size(a) for a in arrays])[:-1]
    return [part.reshape(np.shape(a)) for part, a in zip(np.split(out, sizes), arrays)]
