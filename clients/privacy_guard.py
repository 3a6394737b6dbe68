"""The device's privacy guard under user-level DP: a Flower mod in front of `secaggplus_mod` that enforces the
device's own policy (`fedrec_flwr.fedgnn.device_policy`) on every secure round, whatever the server asks.

At each SecAgg+ stage, before Flower's mod touches keys, shares or the update:
- setup: every node shares with every other (so the device can count the sum's nodes) and the reconstruction
  threshold is at least 2/3 of the shares;
- share keys / collect masked vectors: the round has at least the noise floor's K nodes; before the update is
  computed, the run's sigma and C are within the device's limits and one more round fits its budget;
- collect masked vectors: the round is a training or evaluation round set up with its own SecAgg+ range, and it
  is charged in full (sigma, as at the floor) before the masked vector leaves, and the vector leaves no sooner than
  the policy's `reply_seconds` after the request (`hold_reply`: its timing shows neither whether the device's users
  sampled themselves nor how much data they hold);
- unmask: the active and dead lists are consistent with what the device saw (`check_secure_round`); only then
  does Flower's mod release its shares, and the device settles the round's charge at the noise the sum carries
  (sigma sqrt(k / K) for k active nodes).
Plain training messages (but registration), plain evaluation requests and any message carrying a neighbour-service
link are refused. A refusal raises
`PolicyRefusal`: the device drops out of the round, its update never released. The ledger lives in the node's state
(Context.state), or, where the node has a `state-dir`, only in a file beside its secret.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
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
from fedrec_flwr.fedgnn.protocol import PHASE_EVALUATE_SUM, PHASE_REGISTER, PHASE_TRAIN
from fedrec_flwr.fsutil import atomic_write, exclusive_lock

log = logging.getLogger(__name__)

STATE_KEY = "fedrec.device"  # the node's own record: its ledger, a pending charge (and, in a simulation, its secret)
FIT_CONFIG = "fitins.config"  # where Flower's compat layer puts a fit message's config (the round's phase)
NEIGHBOUR_KEY_PREFIX = "nb_"  # the round config's neighbour-service link (`fedgnn.protocol.RoundConfig`)


@dataclass(frozen=True)
class DeviceTerms:
    """What a device computes for itself about a user-DP run: its policy, the sampling rate q and sigma from the run's
    config and its own count of users, the clip norm, the noise floor K, the SecAgg+ ranges an honest server sets
    (per-coordinate clipping and quantisation), and where its ledger is kept on disk."""

    policy: DevicePolicy
    q: float
    noise_multiplier: float
    clip_norm: float
    floor: int
    clipping_range: float = 0.0
    quantization_range: int = 0
    ledger_file: Path | None = None
    eval_noise_multiplier: float = 0.0  # sigma_e of the released evaluations (sensitivity 1)
    eval_clipping_range: float = 0.0

    @property
    def share_std(self) -> float:
        """This node's noise share on a training vector: sigma C / sqrt(K)."""
        return share_std(self.noise_multiplier, self.clip_norm, self.floor)

    @property
    def eval_share_std(self) -> float:
        """This node's noise share on an evaluation vector: sigma_e / sqrt(K)."""
        return share_std(self.eval_noise_multiplier, 1.0, self.floor)

    def charge_of(self, phase: str) -> tuple[float, float]:
        """(sampling rate, noise multiplier at the floor) of a secure round of `phase`: a training round samples
        users with q; an evaluation has every user in it."""
        if phase == PHASE_TRAIN:
            return self.q, self.noise_multiplier
        if phase == PHASE_EVALUATE_SUM:
            return 1.0, self.eval_noise_multiplier
        raise PolicyRefusal(f"a secure round of phase {phase!r}: this device sums training updates and "
                            f"evaluations only")

    def clipping_range_of(self, phase: str) -> float:
        """The SecAgg+ clipping range an honest server sets for a round of `phase`."""
        return self.eval_clipping_range if phase == PHASE_EVALUATE_SUM else self.clipping_range


def load_ledger(context: Context, terms: DeviceTerms) -> DeviceLedger:
    """The device's ledger: its file where it has one (the single record across runs and restarts), else its node
    state, else empty."""
    if terms.ledger_file is not None:
        return DeviceLedger.from_json(terms.ledger_file.read_text(encoding="utf-8")) \
            if terms.ledger_file.is_file() else DeviceLedger()
    text = _recorded(context, "ledger")
    return DeviceLedger() if text is None else DeviceLedger.from_json(str(text))


def save_ledger(context: Context, terms: DeviceTerms, ledger: DeviceLedger) -> None:
    """Keep the ledger: in its file (written atomically) where the device has one, else in the node state."""
    if terms.ledger_file is not None:
        atomic_write(terms.ledger_file, ledger.to_json().encode())
    else:
        _record(context, "ledger", ledger.to_json())


@contextmanager
def ledger_lock(terms: DeviceTerms):
    """An exclusive lock on the ledger file for a read-modify-write (two runs on one device charge in turn)."""
    if terms.ledger_file is None:
        yield
        return
    with exclusive_lock(terms.ledger_file.with_suffix(".lock")):
        yield


def _recorded(context: Context, key: str, default=None):
    """A value the guard keeps in the node's own record (never sent)."""
    rec = context.state.config_records.get(STATE_KEY)
    return rec[key] if rec is not None and key in rec else default


def _record(context: Context, key: str, value) -> None:
    """Keep `value` in the node's own record."""
    rec = context.state.config_records.get(STATE_KEY) or ConfigRecord({})
    rec[key] = value
    context.state.config_records[STATE_KEY] = rec


def _phase(msg: Message) -> str:
    rec = msg.content.config_records.get(FIT_CONFIG)
    return str(rec.get("phase", "")) if rec is not None else ""


def privacy_guard(terms_of: Callable[[Context], DeviceTerms], clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep):
    """The guard mod for user-DP runs; `terms_of(context)` gives the device's terms for the run (`DeviceTerms`).
    `clock` and `sleep` time the masked-vector reply (`hold_reply`)."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        if msg.metadata.message_type == MessageType.EVALUATE:  # exact error sums: only through the secure sum
            raise PolicyRefusal("a user-DP device sends no plain evaluation; its error sums go through SecAgg+ only")
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        fit = msg.content.config_records.get(FIT_CONFIG)
        if fit is not None and any(str(k).startswith(NEIGHBOUR_KEY_PREFIX) for k in fit):
            # a neighbour-service link would send the users' embeddings and item tokens outside SecAgg+, to an
            # address the server chose: a user-DP device does no graph expansion
            raise PolicyRefusal("a user-DP device does no graph expansion; refused a message carrying a "
                                "neighbour-service link")
        if RECORD_KEY_CONFIGS not in msg.content.config_records:
            if _phase(msg) != PHASE_REGISTER:  # a plain upload would carry one node's vector with 1/sqrt(K) noise
                raise PolicyRefusal(f"a user-DP device sends nothing outside SecAgg+ but its registration; "
                                    f"refused a plain {_phase(msg) or 'unlabelled'} message")
            return call_next(msg, context)
        configs = msg.content.config_records[RECORD_KEY_CONFIGS]
        stage = str(configs.get(Key.STAGE, ""))
        terms = terms_of(context)
        if stage == Stage.SETUP:
            _record(context, "pending", [])  # a pending charge of an earlier round stays charged in full
            _record(context, "setup_range", _check_setup(configs, terms))
        elif stage == Stage.SHARE_KEYS:
            # one per node
            _admit_count(sum(1 for k in configs if k != Key.STAGE), terms.floor, "nodes exchanging keys")
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            started = clock()
            _admit_count(len(configs[Key.CIPHERTEXT_LIST]) + 1, terms.floor, "nodes sending masked vectors")
            phase = _phase(msg)
            q, sigma = terms.charge_of(phase)
            if not math.isclose(float(_recorded(context, "setup_range", math.nan)), terms.clipping_range_of(phase),
                                rel_tol=1e-9):
                raise PolicyRefusal(f"a {phase} round set up with another round's SecAgg+ clipping range")
            terms.policy.admit_run(sigma, terms.clip_norm)  # the same minimum for updates and evaluations
            with ledger_lock(terms):  # charged in full (sigma, as at the floor) before the masked vector leaves
                ledger = load_ledger(context, terms)
                ledger.admit(terms.policy, q, sigma)
                ledger.charge(q, sigma)
                save_ledger(context, terms, ledger)
            _record(context, "pending", [q, sigma])
            reply = call_next(msg, context)
            hold_reply(started, terms.policy.reply_seconds, clock, sleep)
            return reply
        elif stage == Stage.UNMASK:
            state = context.state.config_records[RECORD_KEY_STATE]
            own, threshold = int(state["nid"]), int(state["threshold"])
            known = {int(n) for n in state.get("rd_seed_share_dict:K", [])}
            active = list(configs[Key.ACTIVE_NODE_ID_LIST])
            check_secure_round(own, active, list(configs[Key.DEAD_NODE_ID_LIST]), known, threshold, terms.floor)
            reply = call_next(msg, context)
            pending = [float(x) for x in _recorded(context, "pending", [])]
            if not reply.has_error() and pending:  # the sum's k shares: charge what it carries
                with ledger_lock(terms):
                    ledger = load_ledger(context, terms)
                    ledger.refund(*pending)
                    ledger.charge(pending[0], charged_multiplier(pending[1], len(active), terms.floor))
                    save_ledger(context, terms, ledger)
                _record(context, "pending", [])
            return reply
        return call_next(msg, context)

    return mod


def hold_reply(started: float, reply_seconds: float, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until `reply_seconds` after `started`: a masked vector then leaves at the same time whether the device's
    users sampled themselves and trained or not, and whatever their number of ratings, so the server cannot time
    the subsampling the accounting relies on. A step that overran the deadline is logged: that round's timing
    may show it (raise node config privacy-reply-seconds)."""
    left = started + reply_seconds - clock()
    if left > 0:
        sleep(left)
    elif reply_seconds > 0:
        log.warning("the secure-sum reply took %.1f s, past privacy-reply-seconds = %g: its timing may show whether "
                    "this device trained; raise privacy-reply-seconds", reply_seconds - left, reply_seconds)


def _check_setup(configs, terms: DeviceTerms) -> float:
    """The round's clipping range, or PolicyRefusal unless SecAgg+'s setup is what an honest server sends this
    device: every node shares with every other, a threshold of at least 2/3, at least K nodes, and the ranges the
    device computes itself for a training or an evaluation round (a server that gave other nodes another weight or
    range could leave this node's vector alone in the sum)."""
    shares, sampled = int(configs[Key.SHARE_NUMBER]), int(configs[Key.SAMPLE_NUMBER])
    if shares != sampled:
        raise PolicyRefusal(f"SecAgg+ shares with {shares} of {sampled} nodes: this device must share with "
                            "every node to count the nodes in the sum (privacy.secagg_shares = 1)")
    terms.policy.admit_threshold(int(configs[Key.THRESHOLD]), shares)
    _admit_count(sampled, terms.floor, "nodes sampled")
    expected = {Key.MAX_WEIGHT: 1.0, Key.MOD_RANGE: float(2**32), Key.TARGET_RANGE: float(terms.quantization_range)}
    for key, want in expected.items():
        got = float(configs[key])
        if not math.isclose(got, want, rel_tol=1e-9):
            raise PolicyRefusal(f"SecAgg+ setup {key} = {got:g}, not the {want:g} this device computes for the run")
    got = float(configs[Key.CLIPPING_RANGE])
    if not any(math.isclose(got, want, rel_tol=1e-9) for want in (terms.clipping_range, terms.eval_clipping_range)):
        raise PolicyRefusal(f"SecAgg+ setup {Key.CLIPPING_RANGE} = {got:g}, neither the {terms.clipping_range:g} of a "
                            f"training round nor the {terms.eval_clipping_range:g} of an evaluation this "
                            f"device computes")
    return got


def _admit_count(nodes: int, floor: int, what: str) -> None:
    if nodes < floor:
        raise PolicyRefusal(f"the secure round has {nodes} {what}, fewer than this device's noise floor of {floor}")
