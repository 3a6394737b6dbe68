"""Failure injection for resilience tests and benchmarks: crashing, straggling and malformed clients.

Each decision is drawn from a generator seeded by (run seed, round, the node's first user), so a
rerun injects the same faults in the same rounds and clean and faulty runs differ only there.
"""

from __future__ import annotations

import time

import numpy as np

from fedrec_flwr.config import FaultConfig


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
