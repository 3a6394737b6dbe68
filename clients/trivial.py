"""A client that does no work: the baseline for Flower's own per-round overhead."""

from __future__ import annotations

import numpy as np
from flwr.client import NumPyClient


class TrivialClient(NumPyClient):
    """Echoes the parameters it receives; benchmarks divide real round times by this one's."""

    def fit(self, parameters, config):
        """Return the received arrays unchanged."""
        return parameters, 1, {}

    def evaluate(self, parameters, config):
        """Report a zero loss."""
        return 0.0, 1, {}


def trivial_parameters(num_floats: int) -> list[np.ndarray]:
    """The payload the trivial job sends each client: one float32 vector."""
    return [np.zeros(num_floats, np.float32)]
