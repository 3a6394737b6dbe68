"""Plain FedAvg that records per-round wall time and traffic, for the trivial baseline job."""

from __future__ import annotations

import time

from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg

from fedrec_flwr.messages import array_bytes
from fedrec_flwr.reporting.results import RunRecorder


class TimedFedAvg(FedAvg):
    """FedAvg over a fixed number of clients per round, writing round time and bytes to results.json."""

    def __init__(self, recorder: RunRecorder, clients_per_round: int, rounds: int, initial: list, **kwargs):
        super().__init__(
            fraction_fit=0.0, fraction_evaluate=0.0, min_fit_clients=clients_per_round,
            min_evaluate_clients=0, min_available_clients=clients_per_round,
            initial_parameters=ndarrays_to_parameters(initial), **kwargs,
        )
        self.recorder, self.rounds, self.bytes = recorder, rounds, array_bytes(initial)
        self._t0 = time.time()

    def configure_fit(self, server_round, parameters, client_manager):
        """Start the round clock, then sample as FedAvg does."""
        self._t0 = time.time()
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        """Average as FedAvg does and record the round."""
        out = super().aggregate_fit(server_round, results, failures)
        up = sum(array_bytes(parameters_to_ndarrays(r.parameters)) for _, r in results) / max(len(results), 1)
        self.recorder.add_round({"round": server_round, "phase": "train", "clients": len(results),
                                 "accepted": len(results), "rejected": len(failures),
                                 "bytes_down": self.bytes, "bytes_up": up, "round_seconds": time.time() - self._t0})
        if server_round == self.rounds:
            self.recorder.finish({"rounds": self.rounds})
        return out

    def configure_evaluate(self, server_round, parameters, client_manager):
        """No evaluation: the trivial job measures training rounds only."""
        return []
