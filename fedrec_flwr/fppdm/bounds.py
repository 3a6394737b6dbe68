"""FPPDM's value bounds: the largest |mu| and sigma a domain's model outputs, so the largest an honest upload or a
barycenter of honest uploads can be, and what the server accepts.

The bounds hold by construction: the Gaussian LightGCN clamps its propagated mu to [-R, R] and its sigma to at most
S (`models.gaussian_gcn.GaussianLightGCN`), so no honest upload is refused at any training setting. They are set
far above where training goes (users and items start at mu ~ N(0, 0.1^2) and sigma ~ 1, and the hinge
`margin + W2^2(u, pos) - W2^2(u, neg)` stops pulling once a negative is `margin` further than a positive, so
values scale with sqrt(margin)), where the clamp is the identity: R = SCALE_MULTIPLE sqrt(margin) and
S = 1 + R. Measured honest maxima: |mu| 0.68 and sigma 1.60 on Douban Book + Music (its 12-round preset),
|mu| 6.38 after one round at the paper's settings on Amazon Phone + Electronics (batch 256, 5 local epochs).
"""

from __future__ import annotations

import math

SCALE_MULTIPLE = 16.0  # R in units of sqrt(margin): 2.5x the largest honest |mu| measured at the paper's settings
MAX_ABS_MU = SCALE_MULTIPLE  # the derived bounds at the default margin of 1
MAX_SIGMA = 1.0 + SCALE_MULTIPLE


def derived_value_bounds(margin: float) -> tuple[float, float]:
    """(R, S) derived from the hinge margin: (SCALE_MULTIPLE sqrt(margin), 1 + SCALE_MULTIPLE sqrt(margin))."""
    reach = SCALE_MULTIPLE * math.sqrt(margin)
    return reach, 1.0 + reach


def value_bounds(server, margin: float) -> tuple[float, float]:
    """(largest |mu|, largest sigma) of the run: `fppdm.server.max_abs_mu` / `max_sigma` where set, else derived from
    the margin (`derived_value_bounds`). The domains' models clamp to them and the server checks them."""
    reach, spread = derived_value_bounds(margin)
    return (server.max_abs_mu or reach, server.max_sigma or spread)
