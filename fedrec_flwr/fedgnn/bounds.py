"""What an honest FedGNN upload can look like, so the server refuses what no honest client sends.

With LDP on, every coordinate an honest client uploads is clip(g, delta) + Laplace(lambda) noise,
so |x| <= delta + t except with probability P(|Laplace(lambda)| > t) = exp(-t / lambda) per
coordinate. For an upload of C coordinates, t = lambda * ln(C / p) bounds the probability that an
honest upload has any coordinate past the bound by C * exp(-t / lambda) = p (union bound).
A coordinate bound alone lets a poisoner set every coordinate near it (about delta + 28 lambda at C = 1e6,
some 20 times an honest upload's norm). So each block of an upload (the model gradients; the item rows)
is also held to the L1 norm an honest block can have: its coordinates |clip(g_i) + L_i| are independent,
each with mean at most delta + lambda exp(-delta / lambda), and a Chernoff bound on their sum
(`ldp_l1_bound`) exceeds an honest block's L1 norm with probability at most q, whatever the clipped values. The three
checks (coordinates, two blocks) share FALSE_REJECTION by the union bound: an honest client is wrongly
refused at most once in a million uploads. What still passes is at most what an honest client could
send in L1: a block whose coordinates all sit near delta + lambda exp(-delta / lambda) (plus the margin), the
same sign everywhere (benchmarks.poisoning measures that attacker).
With LDP off there is no mechanism to bound by, so the operator sets an L2 norm bound per block.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import optimize

from fedrec_flwr.config import MergeConfig, PrivacyConfig
from fedrec_flwr.messages import UploadRejected

FALSE_REJECTION = 1e-6  # per honest upload, with LDP on
PER_CHECK = FALSE_REJECTION / 3  # its share for each of the three checks (coordinates, model block, rows block)


def ldp_coordinate_bound(clip_delta: float, noise_lambda: float, coordinates: int,
                         false_rejection: float = FALSE_REJECTION) -> float:
    """Largest |coordinate| an honest LDP upload of `coordinates` values has, except with prob. `false_rejection`."""
    return clip_delta + noise_lambda * math.log(max(coordinates, 1) / false_rejection)


def abs_laplace_mgf(s: float, shift: float, noise_lambda: float) -> float:
    """E exp(s |shift + L|) for L ~ Laplace(noise_lambda), 0 <= s < 1 / lambda (closed form, three pieces of the
    integral: l >= 0, -shift <= l < 0, l < -shift). It grows with |shift|, so shift = delta is the worst case
    over every clipped value (checked numerically in tests/test_trust_boundaries.py)."""
    a, lam = abs(shift), noise_lambda
    return (math.exp(s * a) / (2 * (1 - s * lam))
            + math.exp(s * a) * (1 - math.exp(-(s + 1 / lam) * a)) / (2 * (1 + s * lam))
            + math.exp(-a / lam) / (2 * (1 - s * lam)))


@lru_cache(maxsize=None)  # one entry per block size: users' set sizes are fixed at registration
def ldp_l1_bound(clip_delta: float, noise_lambda: float, coordinates: int,
                 false_rejection: float = FALSE_REJECTION) -> float:
    """Largest L1 norm an honest LDP block of `coordinates` values has, except with probability `false_rejection`.

    Chernoff: P(sum |x_i + L_i| >= t) <= exp(C log M(s) - s t) for every 0 < s < 1/lambda, with M the moment
    generating function of |delta + L| (`abs_laplace_mgf`, the worst case of any |x_i| <= delta), minimised
    over s. Its mean per coordinate is delta + lambda exp(-delta / lambda) (0.221 at the paper's 0.1 / 0.2),
    so the bound is that plus a margin shrinking as 1/sqrt(C)."""
    if coordinates <= 0:
        return 0.0
    log_p = math.log(false_rejection)

    def threshold(s: float) -> float:
        return (coordinates * math.log(abs_laplace_mgf(s, clip_delta, noise_lambda)) - log_p) / s

    best = optimize.minimize_scalar(threshold, bounds=(1e-9 / noise_lambda, (1 - 1e-9) / noise_lambda),
                                    method="bounded")
    return float(best.fun)


def check_upload_bounds(privacy: PrivacyConfig, merge: MergeConfig, arrays: list[np.ndarray]) -> None:
    """UploadRejected if one user's upload (float32 model gradients, then the item rows last) is not one an honest
    client could send: with LDP, a coordinate past the Laplace tail or a block whose L1 norm is past its Chernoff
    bound (each at FALSE_REJECTION / 3); without, a block whose L2 norm exceeds merge.upload_norm_bound."""
    *model, rows = arrays
    if privacy.ldp:
        share = PER_CHECK
        coordinates = sum(a.size for a in arrays)
        bound = ldp_coordinate_bound(privacy.clip_delta, privacy.noise_lambda, coordinates, share)
        magnitudes = [np.abs(a) for a in arrays]  # one pass per array for both the peak and the L1 norms
        peak = max((float(m.max()) for m in magnitudes if m.size), default=0.0)
        if peak > bound:
            raise UploadRejected(f"a coordinate of {peak:.3g} exceeds the LDP bound {bound:.3g} "
                                 f"(clip {privacy.clip_delta:g} + Laplace({privacy.noise_lambda:g}) tail)")
        for name, block in (("model gradients", magnitudes[:-1]), ("item rows", magnitudes[-1:])):
            size = sum(a.size for a in block)
            norm = math.fsum(float(a.sum(dtype=np.float64)) for a in block)
            limit = ldp_l1_bound(privacy.clip_delta, privacy.noise_lambda, size, share)
            if norm > limit:
                raise UploadRejected(f"{name}: L1 norm {norm:.4g} over {size} coordinates exceeds the {limit:.4g} an "
                                     f"honest LDP upload reaches (clip {privacy.clip_delta:g} + Laplace"
                                     f"({privacy.noise_lambda:g}) noise, false rejection {share:.1g})")
    elif merge.upload_norm_bound:
        for name, block in (("model gradients", model), ("item rows", [rows])):
            norm = math.sqrt(math.fsum(float(np.square(a, dtype=np.float64).sum()) for a in block))
            if norm > merge.upload_norm_bound:
                raise UploadRejected(f"{name}: L2 norm {norm:.3g} exceeds merge.upload_norm_bound "
                                     f"{merge.upload_norm_bound:g}")
