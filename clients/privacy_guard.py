"""The device's privacy guard under user-level DP: a Flower mod in front of `secaggplus_mod` that enforces the
device's own policy (`fedrec_flwr.fedgnn.device_policy`) on every secure round, whatever the server asks.

At each SecAgg+ stage, before Flower's mod touches keys, shares or the update:
- setup: every node shares with every other (so the device can count the sum's nodes) and the reconstruction
  threshold is at least 2/3 of the shares;
- share keys / collect masked vectors: the round has at least the noise floor's K nodes; before the update is
  computed, the run's sigma and C are within the device's limits and one more round fits its budget;
- unmask: the active and dead lists are consistent with what the device saw (`check_secure_round`); only then
  does Flower's mod release its shares, and the device charges its ledger at the noise the sum carries
  (sigma sqrt(k / K) for k active nodes).
A refusal raises `PolicyRefusal`: the device drops out of the round, its update never released. The ledger lives in
the node's state (Context.state) and, where the node has a `state-dir`, in a file beside its secret.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flwr.app import ConfigRecord
from flwr.app.message_type import MessageType
from flwr.common import Context, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage

from fedrec_flwr.fedgnn.device_policy import (
    DeviceLedger,
    DevicePolicy,
    PolicyRefusal,
    charged_multiplier,
    check_secure_round,
    share_std,
)
from fedrec_flwr.fsutil import atomic_write

log = logging.getLogger(__name__)
STATE_KEY = "fedrec.device"  # the node's own record: its ledger (and, in a simulation, its secret)


@dataclass(frozen=True)
class DeviceTerms:
    """What a device computes for itself about a user-DP run: its policy, the sampling rate q and sigma from the run's
    config and its own count of users, the clip norm, the noise floor K, and where its ledger is kept on disk."""

    policy: DevicePolicy
    q: float
    noise_multiplier: float
    clip_norm: float
    floor: int
    ledger_file: Path | None = None

    @property
    def share_std(self) -> float:
        """This node's noise share: sigma C / sqrt(K)."""
        return share_std(self.noise_multiplier, self.clip_norm, self.floor)


def load_ledger(context: Context, terms: DeviceTerms) -> DeviceLedger:
    """The device's ledger: from its node state, else its file, else empty."""
    rec = context.state.config_records.get(STATE_KEY)
    if rec is not None and "ledger" in rec:
        return DeviceLedger.from_json(str(rec["ledger"]))
    if terms.ledger_file is not None and terms.ledger_file.is_file():
        return DeviceLedger.from_json(terms.ledger_file.read_text(encoding="utf-8"))
    return DeviceLedger()


def save_ledger(context: Context, terms: DeviceTerms, ledger: DeviceLedger) -> None:
    """Keep the ledger in the node state (and its file)."""
    rec = context.state.config_records.get(STATE_KEY) or ConfigRecord({})
    rec["ledger"] = ledger.to_json()
    context.state.config_records[STATE_KEY] = rec
    if terms.ledger_file is not None:
        atomic_write(terms.ledger_file, ledger.to_json().encode())


def privacy_guard(terms_of: Callable[[Context], DeviceTerms]):
    """The guard mod; `terms_of(context)` gives the device's terms for the run (`DeviceTerms`)."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
            return call_next(msg, context)
        configs = msg.content.config_records[RECORD_KEY_CONFIGS]
        stage = str(configs.get(Key.STAGE, ""))
        terms = terms_of(context)
        if stage == Stage.SETUP:
            shares, sampled = int(configs[Key.SHARE_NUMBER]), int(configs[Key.SAMPLE_NUMBER])
            if shares != sampled:
                raise PolicyRefusal(f"SecAgg+ shares with {shares} of {sampled} nodes: this device must share with "
                                    "every node to count the nodes in the sum (privacy.secagg_shares = 1)")
            terms.policy.admit_threshold(int(configs[Key.THRESHOLD]), shares)
            _admit_count(sampled, terms.floor, "nodes sampled")
        elif stage == Stage.SHARE_KEYS:
            _admit_count(sum(1 for k in configs if k != Key.STAGE), terms.floor, "nodes exchanging keys")  # one per node
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            _admit_count(len(configs[Key.CIPHERTEXT_LIST]) + 1, terms.floor, "nodes sending masked vectors")
            terms.policy.admit_run(terms.noise_multiplier, terms.clip_norm)
            load_ledger(context, terms).admit(terms.policy, terms.q, terms.noise_multiplier)
        elif stage == Stage.UNMASK:
            state = context.state.config_records[RECORD_KEY_STATE]
            own, threshold = int(state["nid"]), int(state["threshold"])
            known = {int(n) for n in state.get("rd_seed_share_dict:K", [])}
            active = list(configs[Key.ACTIVE_NODE_ID_LIST])
            check_secure_round(own, active, list(configs[Key.DEAD_NODE_ID_LIST]), known, threshold, terms.floor)
            reply = call_next(msg, context)
            if not reply.has_error():
                ledger = load_ledger(context, terms)
                ledger.charge(terms.q, charged_multiplier(terms.noise_multiplier, len(active), terms.floor))
                save_ledger(context, terms, ledger)
            return reply
        return call_next(msg, context)

    return mod


def _admit_count(nodes: int, floor: int, what: str) -> None:
    if nodes < floor:
        raise PolicyRefusal(f"the secure round has {nodes} {what}, fewer than this device's noise floor of {floor}")
