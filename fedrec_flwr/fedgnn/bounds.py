"""What an honest FedGNN upload can look like, so the server refuses what no honest client sends.

With LDP on, every coordinate an honest client uploads is clip(g, delta) + Laplace(lambda) noise,
so |x| <= delta + t except with probability P(|Laplace(lambda)| > t) = exp(-t / lambda) per
coordinate. For an upload of C coordinates, t = lambda * ln(C / p) bounds the probability that an
honest upload has any coordinate past the bound by C * exp(-t / lambda) = p (union bound).
With p = FALSE_REJECTION (1e-6) an honest client is wrongly refused at most once in a million
uploads; a poisoned coordinate must stay within about delta + 28 lambda to pass at C = 1e6.
With LDP off there is no mechanism to bound by, so the operator sets an L2 norm bound.
"""

from __future__ import annotations

import math

import numpy as np

from fedrec_flwr.config import MergeConfig, PrivacyConfig
from fedrec_flwr.messages import UploadRejected

FALSE_REJECTION = 1e-6  # per honest upload, with LDP on


def ldp_coordinate_bound(clip_delta: float, noise_lambda: float, coordinates: int,
                         false_rejection: float = FALSE_REJECTION) -> float:
    """Largest |coordinate| an honest LDP upload of `coordinates` values has, except with prob. `false_rejection`."""
    return clip_delta + noise_lambda * math.log(max(coordinates, 1) / false_rejection)


def check_upload_bounds(privacy: PrivacyConfig, merge: MergeConfig, arrays: list[np.ndarray]) -> None:
    """UploadRejected if one user's upload (float32 model gradients and item rows) is out of bounds."""
    if privacy.ldp:
        coordinates = sum(a.size for a in arrays)
        bound = ldp_coordinate_bound(privacy.clip_delta, privacy.noise_lambda, coordinates)
        peak = max((float(np.abs(a).max()) for a in arrays if a.size), default=0.0)
        if peak > bound:
            raise UploadRejected(f"a coordinate of {peak:.3g} exceeds the LDP bound {bound:.3g} "
                                 f"(clip {privacy.clip_delta:g} + Laplace({privacy.noise_lambda:g}) tail)")
    elif merge.upload_norm_bound:
        norm = math.sqrt(math.fsum(float(np.square(a, dtype=np.float64).sum()) for a in arrays))
        if norm > merge.upload_norm_bound:
            raise UploadRejected(f"upload L2 norm {norm:.3g} exceeds merge.upload_norm_bound "
                                 f"{merge.upload_norm_bound:g}")
