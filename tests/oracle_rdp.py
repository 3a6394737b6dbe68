"""Closed forms of the LDP accounting, written out independently of `fedrec_flwr.fedgnn.accounting` and of
dp-accounting's RDP code, kept as a test oracle: the Renyi divergences of the Laplace mechanism and of binary
randomised response, and the conversion of an RDP curve to (epsilon, delta)-DP.

References: Mironov, "Renyi Differential Privacy" (2017), Proposition 6 (Laplace) and Table II (randomised
response); Canonne, Kamath, Steinke (2020), Proposition 12 / Asoodeh et al. (2020), the conversion.
"""

from __future__ import annotations

import math

import numpy as np

# Renyi orders the oracle optimises over: the grid dp-accounting's RDP accountant uses, so both minimise over the
# same points (the grid only picks where the bound is read, not what it is)
ORDERS = np.concatenate([np.linspace(1.1, 10.9, 99), np.arange(11, 64), [128, 256, 512, 1024]])


def laplace_rdp(epsilon: float, order: float) -> float:
    """D_a of Laplace(b) shifted by its sensitivity s, with epsilon = s / b:
    1/(a-1) log( a/(2a-1) e^{(a-1) eps} + (a-1)/(2a-1) e^{-a eps} )."""
    a = float(order)
    return float(np.logaddexp(math.log(a / (2 * a - 1)) + (a - 1) * epsilon,
                              math.log((a - 1) / (2 * a - 1)) - a * epsilon)) / (a - 1)


def randomized_response_rdp(epsilon: float, order: float) -> float:
    """D_a of one bit reported truthfully with probability e^eps / (1 + e^eps):
    1/(a-1) log( (e^{a eps} + e^{(1-a) eps}) / (1 + e^eps) )."""
    a = float(order)
    return float(np.logaddexp(a * epsilon, (1 - a) * epsilon) - np.logaddexp(0.0, epsilon)) / (a - 1)


def rdp_to_dp(rdp: np.ndarray, delta: float, orders: np.ndarray = ORDERS) -> float:
    """epsilon at delta of an RDP curve: min over orders a of rdp(a) + log(1 - 1/a) - log(delta a) / (a - 1)."""
    a = np.asarray(orders, np.float64)
    return max(0.0, float(np.min(rdp + np.log1p(-1 / a) - np.log(delta * a) / (a - 1))))


def ldp_epsilon(clip_delta: float, noise_lambda: float, mechanisms: int, delta: float, report_bits: int = 0,
                report_epsilon: float = 0.0) -> float:
    """epsilon at delta of `mechanisms` Laplace coordinates (sensitivity 2 clip_delta, scale noise_lambda) and
    `report_bits` randomised-response bits at report_epsilon: the smaller of the RDP bound and the basic sum."""
    eps = 2.0 * clip_delta / noise_lambda
    basic = mechanisms * eps + report_bits * report_epsilon
    if basic <= 0:
        return 0.0
    rdp = np.array([mechanisms * laplace_rdp(eps, a) + report_bits * (randomized_response_rdp(report_epsilon, a)
                                                                       if report_bits else 0.0) for a in ORDERS])
    return min(rdp_to_dp(rdp, delta), basic)
