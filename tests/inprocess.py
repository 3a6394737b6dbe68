"""Drive a Flower strategy and NumPyClients round by round in one process (no SuperLink, no Ray).

Tests use it to check protocol invariants (framing, node/user mapping, rejection, resume)
exactly as `flwr run` would exercise them, in a fraction of the time.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.common import (
    Code,
    EvaluateRes,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)

OK = Status(Code.OK, "")


@dataclass(frozen=True)
class Proxy:
    """Stands in for a ClientProxy: only the node id matters to the strategies."""

    node_id: int


class Manager:
    """Stands in for a ClientManager over a fixed set of nodes."""

    def __init__(self, node_ids):
        self.proxies = {nid: Proxy(nid) for nid in node_ids}

    def all(self):
        """cid (str) -> proxy, as Flower's client manager returns them (keys are not the int node ids)."""
        return {str(nid): p for nid, p in self.proxies.items()}


def drive(strategy, clients: dict, last_round: int | None = None) -> None:
    """Run Flower rounds 1..last_round (default: all) of `strategy` against `clients` {node id: NumPyClient}.

    A client that raises counts as a failure, as in Flower.
    """
    manager = Manager(clients)
    params = strategy.initialize_parameters(manager)
    for rnd in range(1, (last_round or strategy.num_rounds) + 1):
        results, failures = [], []
        for proxy, ins in strategy.configure_fit(rnd, params, manager):
            try:
                arrays, n, metrics = clients[proxy.node_id].fit(parameters_to_ndarrays(ins.parameters), ins.config)
                results.append((proxy, FitRes(OK, ndarrays_to_parameters(arrays), n, metrics)))
            except Exception as exc:  # noqa: BLE001  (Flower turns a client exception into a failure)
                failures.append(exc)
        params, _ = strategy.aggregate_fit(rnd, results, failures)
        eval_results = []
        for proxy, ins in strategy.configure_evaluate(rnd, params, manager):
            loss, n, metrics = clients[proxy.node_id].evaluate(parameters_to_ndarrays(ins.parameters), ins.config)
            eval_results.append((proxy, EvaluateRes(OK, loss, n, metrics)))
        if eval_results:
            strategy.aggregate_evaluate(rnd, eval_results, [])
