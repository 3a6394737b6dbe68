"""A FedGNN device's own limits and ledger under user-level DP: what it enforces whatever the server asks.

The server sends the run config and orchestrates SecAgg+; a device that trusted it would spend whatever budget,
noise and cohort the server chose. So each device holds (`DevicePolicy`):
- the largest user-level epsilon (at its own delta) it will spend, and its own ledger of what it has spent
  (`DeviceLedger`, kept in the node's state across rounds);
- the smallest noise multiplier and the largest clip norm it accepts;
- the noise floor: it sizes its noise share for the fewest nodes it lets a secure sum have, K (`floor_nodes`:
  a fraction of the run's nodes, and never fewer than `min_nodes`), and refuses a round whose sum would have
  fewer, so no dropout leaves a released sum with less than the run's noise;
- the smallest SecAgg+ reconstruction threshold, 2/3 of the shares: a server that tells some nodes a node
  dropped and others that it is alive then needs 2t - c > n shares from n nodes (c of them colluding clients),
  which holds for any c < n/3, so it cannot collect both of that node's secrets and unmask its vector.

A device sits out (raises `PolicyRefusal`, which drops it from the round) a round that would break any of them.
The limits come from the node config in a deployment (`from_node_config`), from the run's own settings in a
simulation (`from_run`), and from `SAFE_DEFAULTS` otherwise. This module needs no flwr.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from fedrec_flwr.fedgnn.accounting import gaussian_events_epsilon
from fedrec_flwr.privacy_modes import DEVICE_DEFAULT_MODE, PRIVACY_MODES

MIN_THRESHOLD = 2.0 / 3.0  # fraction of SecAgg+ shares needed to unmask (see the module docstring)


class PolicyRefusal(RuntimeError):
    """The device will not take part in this round: taking part would break one of its own limits (named)."""


class DevicePolicyError(ValueError):
    """A device-policy setting of the node config that is missing a valid value (named)."""


@dataclass(frozen=True)
class DevicePolicy:
    """One device's privacy limits under user-level DP (see the module docstring)."""

    max_epsilon: float = 8.0  # user-level epsilon at `delta` the device spends at most (inf: no limit)
    delta: float = 1e-5
    min_noise_multiplier: float = 0.5
    max_clip_norm: float = 1.0
    min_nodes: int = 3  # fewest nodes in a secure sum: with two, each could subtract its own vector
    min_node_fraction: float = 0.8  # the noise floor: shares sized for this fraction of the run's nodes reporting
    min_threshold: float = MIN_THRESHOLD
    mode: str = DEVICE_DEFAULT_MODE  # the only privacy.mode the device takes part in ("user_dp" or "ldp")
    # a secure-sum reply leaves no sooner than this after its request: how long a device computed (did its user
    # sample itself? how many ratings?) must not show in when it answers; 0 in a simulation, which has no such channel
    reply_seconds: float = 5.0
    # the paper's LDP mode (a device opted into privacy-mode ldp): the least protection it uploads under
    max_ldp_epsilon: float = 1.0  # per coordinate of one upload, 2 clip_delta / noise_lambda (the paper's 1)
    max_popularity_epsilon: float = 4.0  # each bit of the popularity report (popularity-matched sampler)
    min_pseudo_items: int = 1000  # uniform sampler: M
    min_pseudo_ratio: int = 2  # popularity-matched sampler: pseudo items per own item
    # an LDP device answers plain evaluation requests (its exact error sums) only if its operator opts in: a server that
    # crafts the evaluation download reads from them which items its user rated and its test ratings
    plain_evaluation: bool = False

    @classmethod
    def from_node_config(cls, node_config) -> "DevicePolicy":
        """A deployed device's policy: node-config keys `privacy-max-epsilon`, `privacy-delta`,
        `privacy-min-noise-multiplier`, `privacy-max-clip-norm`, `privacy-min-nodes`, `privacy-min-node-fraction`,
        `privacy-reply-seconds`, `privacy-mode` (`user_dp` unless the operator opts the device into the paper's
        `ldp`, which promises no per-user guarantee), and for LDP devices `privacy-max-ldp-epsilon`,
        `privacy-max-popularity-epsilon`, `privacy-min-pseudo-items`, `privacy-min-pseudo-ratio` and
        `privacy-plain-evaluation` (true / false; each optional, `SAFE_DEFAULTS` otherwise). A value out of range
        raises DevicePolicyError naming it."""
        values = {}
        for f in fields(cls):
            if f.name == "min_threshold":
                continue
            if f.name == "mode":
                if "privacy-mode" in node_config:
                    values["mode"] = str(node_config["privacy-mode"])
                continue
            key = "privacy-" + f.name.replace("_", "-")
            if key in node_config and f.type in (bool, "bool"):
                values[f.name] = _flag(key, node_config[key])
            elif key in node_config:
                try:
                    values[f.name] = int(node_config[key]) if f.type in (int, "int") else float(node_config[key])
                except (TypeError, ValueError):
                    raise DevicePolicyError(f"node config {key} = {node_config[key]!r} is not a number") from None
        return cls(**{**asdict(SAFE_DEFAULTS), **values}).checked()

    @classmethod
    def from_run(cls, privacy, noise_multiplier: float, eval_noise_multiplier: float = 0.0) -> "DevicePolicy":
        """A simulated device's policy: the run's own settings (its target epsilon, delta, the smaller of its training
        and evaluation sigma, C and floor), so that every simulated device enforces what the experimenter configured,
        with its own ledger."""
        target = float(privacy.target_epsilon) if privacy.target_epsilon > 0 else math.inf
        least = min(float(noise_multiplier), float(eval_noise_multiplier or noise_multiplier))
        return cls(target, float(privacy.delta), least, float(privacy.clip_norm),
                   SAFE_DEFAULTS.min_nodes, float(privacy.min_node_fraction),
                   mode=str(getattr(privacy, "mode", DEVICE_DEFAULT_MODE)), reply_seconds=0.0,
                   plain_evaluation=True).checked()

    def checked(self) -> "DevicePolicy":
        """This policy, or DevicePolicyError naming the first limit out of its range."""
        checks = [("max-epsilon", self.max_epsilon > 0), ("delta", 0 < self.delta < 1),
                  ("min-noise-multiplier", self.min_noise_multiplier > 0), ("max-clip-norm", self.max_clip_norm > 0),
                  ("min-nodes", self.min_nodes >= 3), ("min-node-fraction", 0 < self.min_node_fraction <= 1),
                  ("mode", self.mode in PRIVACY_MODES),
                  ("reply-seconds", 0 <= self.reply_seconds <= 3600),
                  ("max-ldp-epsilon", self.max_ldp_epsilon > 0),
                  ("max-popularity-epsilon", self.max_popularity_epsilon > 0),
                  ("min-pseudo-items", self.min_pseudo_items >= 0), ("min-pseudo-ratio", self.min_pseudo_ratio >= 1)]
        for name, ok in checks:
            if not ok:
                raise DevicePolicyError(f"device policy privacy-{name} = {getattr(self, name.replace('-', '_'))!r} is "
                                        "out of range (epsilon > 0, 0 < delta < 1, noise multiplier > 0, clip norm > "
                                        "0, min nodes >= 3, 0 < node fraction <= 1, mode user_dp or ldp, "
                                        "0 <= reply seconds <= 3600)")
        return self

    @property
    def hides_timing(self) -> bool:
        """Whether the device hides how long it computes (a deployed device): it holds each masked vector until
        `reply_seconds` after the request and runs a cover step for every user that did not sample itself, so
        neither its coins nor, within the deadline, its data show in when it answers."""
        return self.reply_seconds > 0

    def floor_nodes(self, run_nodes: int) -> int:
        """K: the fewest nodes a secure sum may have, for a run of `run_nodes` nodes (`floor_nodes`)."""
        return floor_nodes(self.min_node_fraction, run_nodes, self.min_nodes)

    def admit_mode(self, mode: str) -> None:
        """PolicyRefusal unless the run's privacy.mode is the one this device takes part in."""
        if mode != self.mode:
            raise PolicyRefusal(f"the run asks for privacy.mode = {mode!r}; this device takes part only in "
                                f"{self.mode!r} runs (node config privacy-mode)")

    def admit_ldp(self, privacy) -> None:
        """PolicyRefusal unless an LDP run (the paper's mode) protects this device's uploads at least as its policy
        asks: LDP on, at most `max_ldp_epsilon` per coordinate, at least its pseudo items, and a popularity report
        of at most `max_popularity_epsilon` a bit. The server writes the run config; without this, a run with LDP
        off or no pseudo items would get a device's gradients and rated items in the clear."""
        from fedrec_flwr.fedgnn.accounting import epsilon_per_coordinate

        if not privacy.ldp or privacy.noise_lambda <= 0:
            raise PolicyRefusal("the run turns LDP off; this device uploads only under LDP")
        eps = epsilon_per_coordinate(privacy.clip_delta, privacy.noise_lambda)
        if eps > self.max_ldp_epsilon * (1 + 1e-9):
            raise PolicyRefusal(f"the run asks for LDP epsilon {eps:.4g} per coordinate, above this device's "
                                f"{self.max_ldp_epsilon:.4g}")
        if privacy.popularity_epsilon > self.max_popularity_epsilon * (1 + 1e-9):  # whatever the sampler
            raise PolicyRefusal(f"the run asks for popularity reports at epsilon {privacy.popularity_epsilon:.4g}, "
                                f"above this device's {self.max_popularity_epsilon:.4g}")
        if privacy.pseudo_sampler == "popularity":
            if privacy.pseudo_ratio < self.min_pseudo_ratio:
                raise PolicyRefusal(f"the run asks for {privacy.pseudo_ratio} pseudo items per own item, below this "
                                    f"device's {self.min_pseudo_ratio}")
        elif privacy.pseudo_items < self.min_pseudo_items:
            raise PolicyRefusal(f"the run asks for {privacy.pseudo_items} pseudo items, below this device's "
                                f"{self.min_pseudo_items}")

    def admit_plain_evaluation(self) -> None:
        """PolicyRefusal unless this device answers plain evaluation requests (`plain_evaluation`). Its exact error
        sums are a function of its user's private data with no noise and no limit on how often they are asked: a
        server that sends two downloads differing in one item's row learns whether the user rated that item, and
        one whose model is a constant c learns sum |c - r| over the test ratings, which a few values of c decode."""
        if not self.plain_evaluation:
            raise PolicyRefusal("this device sends no plain evaluation: its exact error sums would tell a server that "
                                "crafts the download which items its user rated (node config "
                                "privacy-plain-evaluation opts in)")

    def admit_run(self, noise_multiplier: float, clip_norm: float) -> None:
        """PolicyRefusal unless the run's sigma and C are within this device's limits."""
        if noise_multiplier < self.min_noise_multiplier * (1 - 1e-9):
            raise PolicyRefusal(f"the run asks for noise multiplier {noise_multiplier:.4g}, below this device's "
                                f"minimum {self.min_noise_multiplier:.4g}")
        if clip_norm > self.max_clip_norm * (1 + 1e-9):
            raise PolicyRefusal(f"the run asks for clip norm {clip_norm:.4g}, above this device's maximum "
                                f"{self.max_clip_norm:.4g}")

    def admit_threshold(self, threshold: int, shares: int) -> None:
        """PolicyRefusal unless SecAgg+'s reconstruction threshold is at least `min_threshold` of the shares."""
        if threshold < math.ceil(self.min_threshold * shares - 1e-9):
            raise PolicyRefusal(f"SecAgg+ threshold {threshold} of {shares} shares is below this device's "
                                f"{self.min_threshold:.3g} (a server could unmask a node below it)")


SAFE_DEFAULTS = DevicePolicy()


def _flag(key: str, value) -> bool:
    """A node-config switch: a bool, or true / false / 1 / 0 as text; DevicePolicyError naming `key` otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    raise DevicePolicyError(f"node config {key} = {value!r} is not true or false")


def floor_nodes(min_node_fraction: float, run_nodes: int, min_nodes: int = SAFE_DEFAULTS.min_nodes) -> int:
    """K = max(ceil(fraction x run_nodes), min_nodes): the fewest nodes whose shares a released sum may hold. Every
    node's share is N(0, sigma^2 C^2 / K), so any sum of k >= K nodes carries at least the run's sigma C."""
    return max(math.ceil(min_node_fraction * run_nodes - 1e-9), int(min_nodes))


def share_std(noise_multiplier: float, clip_norm: float, floor: int) -> float:
    """One node's noise share: sigma C / sqrt(K)."""
    return noise_multiplier * clip_norm / math.sqrt(max(floor, 1))


def charged_multiplier(noise_multiplier: float, nodes_in_sum: int, floor: int) -> float:
    """The noise multiplier a released sum of `nodes_in_sum` node shares actually carries: sigma sqrt(k / K)."""
    return noise_multiplier * math.sqrt(nodes_in_sum / max(floor, 1))


class DeviceLedger:
    """What a device has spent: rounds released at (sampling rate, noise multiplier), RDP-composed by dp-accounting
    (the same accountant as the server's `UserDPAccountant`). Serialised to JSON for the node's state."""

    def __init__(self, rounds: dict[tuple[float, float], int] | None = None):
        self.rounds: dict[tuple[float, float], int] = dict(rounds or {})

    def epsilon(self, delta: float, extra: tuple[float, float] | None = None) -> float:
        """User-level epsilon at `delta` of the rounds charged (plus one `extra` (q, sigma) round)."""
        rounds = dict(self.rounds)
        if extra is not None:
            rounds[extra] = rounds.get(extra, 0) + 1
        return gaussian_events_epsilon(rounds, delta)  # training (q) and evaluations (q = 1) alike

    def admit(self, policy: DevicePolicy, q: float, noise_multiplier: float) -> None:
        """PolicyRefusal if one more round at (q, sigma) would take this device past its max epsilon."""
        after = self.epsilon(policy.delta, (round(q, 12), round(noise_multiplier, 12)))
        if after > policy.max_epsilon * (1 + 1e-9):
            raise PolicyRefusal(f"one more round would spend epsilon {after:.4g} at delta {policy.delta:g}, past this "
                                f"device's limit {policy.max_epsilon:g}")

    def charge(self, q: float, noise_multiplier: float) -> None:
        """Record one released round at (q, sigma)."""
        key = (round(q, 12), round(noise_multiplier, 12))
        self.rounds[key] = self.rounds.get(key, 0) + 1

    def refund(self, q: float, noise_multiplier: float) -> None:
        """Take back one round charged at (q, sigma): a provisional full charge, replaced by what the sum carried."""
        key = (round(q, 12), round(noise_multiplier, 12))
        if self.rounds.get(key, 0) < 1:
            raise ValueError(f"no round charged at {key} to refund")
        self.rounds[key] -= 1
        if not self.rounds[key]:
            del self.rounds[key]

    @property
    def released(self) -> int:
        """Rounds charged."""
        return sum(self.rounds.values())

    def to_json(self) -> str:
        """The ledger as JSON (for the node's state)."""
        return json.dumps([[q, s, n] for (q, s), n in sorted(self.rounds.items())])

    @classmethod
    def from_json(cls, text: str) -> "DeviceLedger":
        """A ledger from `to_json`."""
        return cls({(float(q), float(s)): int(n) for q, s, n in json.loads(text)})


def check_secure_round(own: int, active: list[int], dead: list[int], known: set[int], threshold: int,
                       floor: int) -> None:
    """PolicyRefusal unless the server's SecAgg+ unmask request is one an honest server sends: the active and dead
    lists hold distinct nodes, never the same node in both, only nodes this device exchanged shares with (`known`),
    this device among the active ones, and at least the threshold and the noise floor (K) of active nodes, the
    nodes whose masked vectors, and so noise shares, are in the sum."""
    a, d = list(map(int, active)), list(map(int, dead))
    if len(set(a)) != len(a) or len(set(d)) != len(d) or set(a) & set(d):
        raise PolicyRefusal("the unmask request repeats a node, or calls one node both active and dropped")
    if not set(a) | set(d) <= known:
        raise PolicyRefusal("the unmask request names nodes this device shared no keys with")
    if own not in set(a):
        raise PolicyRefusal("the unmask request does not count this device among the active nodes")
    if len(a) < max(threshold, floor):
        raise PolicyRefusal(f"the unmask request has {len(a)} active nodes, fewer than the threshold {threshold} or "
                            f"the noise floor {floor}: the sum would carry less noise than this device allows")
