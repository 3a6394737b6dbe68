"""Failure injection for resilience tests and benchmarks: crashing, straggling and malformed clients,
as a wrapper around the production client (which holds no fault code).

Each decision is drawn from a generator seeded by (run seed, round, the node's first user), so a
rerun injects the same faults in the same rounds and clean and faulty runs differ only there.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.client import NumPyClient

from clients.fedgnn import FedGNNClient
from fedrec_flwr.config import FaultConfig
from fedrec_flwr.fedgnn.protocol import PHASE_TRAIN, TRAIN_GRADIENTS, RoundConfig, split_download


class InjectedCrash(RuntimeError):
    """Raised by a client that the fault plan makes crash."""


class FaultPlan:
    """What, if anything, goes wrong with a node in a given round."""

    def __init__(self, cfg: FaultConfig, seed: int):
        self.cfg, self.seed = cfg, seed

    def _draw(self, users, server_round: int) -> np.ndarray:
        first = int(np.min(users)) if len(users) else -1
        return np.random.default_rng([self.seed, 7919, server_round, first + 1]).random(3)

    def before_fit(self, users, server_round: int) -> None:
        """Crash or stall as planned for this node and round; returns normally otherwise."""
        c = self.cfg
        if not (c.crash or c.straggle):
            return
        crash, straggle, _ = self._draw(users, server_round)
        if crash < c.crash:
            raise InjectedCrash(f"injected crash (round {server_round}, users {list(users)[:3]})")
        if straggle < c.straggle:
            time.sleep(c.straggle_seconds)

    def corrupt(self, users, server_round: int) -> bool:
        """Whether this node's upload is to be corrupted (NaN) this round."""
        return bool(self.cfg.malformed) and self._draw(users, server_round)[2] < self.cfg.malformed


class FaultyFedGNNClient(NumPyClient):
    """A FedGNN client with the fault plan applied around it: the wrapped client's code is unchanged."""

    def __init__(self, inner: FedGNNClient, cfg: FaultConfig, seed: int):
        self.inner, self.plan = inner, FaultPlan(cfg, seed)

    def fit(self, parameters, config):
        """Crash, stall or corrupt the upload as planned for training rounds; otherwise the inner fit."""
        round_config = RoundConfig.from_flower(config)
        if round_config.phase != PHASE_TRAIN:
            return self.inner.fit(parameters, config)
        _, users, _ = split_download(parameters, self.inner.num_weights)
        self.plan.before_fit(users, round_config.round)
        upload, n, metrics = self.inner.fit(parameters, config)
        if len(users) and self.plan.corrupt(users, round_config.round):
            grads = upload[TRAIN_GRADIENTS]  # the node's users' model gradients, packed: poison the first user's
            grads[: grads.size // len(users)] = np.nan  # a malformed update the server must reject
        return upload, n, metrics

    def evaluate(self, parameters, config):
        """Evaluation is not faulted."""
        return self.inner.evaluate(parameters, config)


def with_faults(client: FedGNNClient, cfg: FaultConfig, seed: int) -> NumPyClient:
    """`client` wrapped in its fault plan when any fault is configured, else `client` itself."""
    return FaultyFedGNNClient(client, cfg, seed) if (cfg.crash or cfg.straggle or cfg.malformed) else client
