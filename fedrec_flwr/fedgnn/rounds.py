"""One FedGNN run's rounds, independent of how messages travel.

The Flower strategy (`strategies.fedgnn`), the in-process runner (`fedrec_flwr.cli.inprocess`) and the test
harness (`tests.inprocess`) are transports over this core, so every round step has exactly one
implementation:

0. popularity (round 0, popularity-matched sampler only): each user sends an LDP report of its items;
   the server checks and sums them and publishes the estimated item counts at registration;
1. register: each node's users send their anonymity sets; a node may speak only for users it is
   entitled to (`NodeBindings`);
2. train: sample users (seeded, by user id), build each node's download (model weights plus the
   item rows of its sampled users' sets), then split each node's reply per user, check that the
   node hosts the user, validate shapes, ids, dtype and bounds, merge what is accepted, apply the
   server optimiser, and count each user's uploads (the privacy budget it spends);
3. evaluate: every `eval_every` training rounds the evaluating users report (SSE, SAE, n), checked
   against what their test ratings could give, and RMSE = sqrt(sum SSE / sum n).

Devices train and report in reference units (ratings mapped onto [1, 5] by the public scale,
`RatingScale.to_units`, where they read their data): the evaluation checks replies in those units
and reports RMSE and MAE on the dataset's own scale (times `public_scale.unit_factor`, 1 on 1-5).

Rejected messages are logged, counted and never averaged in.

The core reads only its sections: `federation`, `privacy`, `merge` (the upload norm bound),
`expansion`, the width of an item row (`models.row_width`: the model's `dim`, + 1 with
model.item_bias) and the run's seed; `FedGNNRounds.from_config` picks them out of a run's config.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from fedrec_flwr.config import ExpansionConfig, FederationConfig, MergeConfig, PrivacyConfig
from fedrec_flwr.data import public_scale
from fedrec_flwr.data.types import RatingScale
from fedrec_flwr.fedgnn.bindings import NodeBindings
from fedrec_flwr.fedgnn.bounds import check_upload_bounds
from fedrec_flwr.fedgnn.lifecycle import Lifecycle
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EXPAND_FETCH,
    PHASE_POPULARITY,
    PHASE_REGISTER,
    PHASE_TRAIN,
    REGISTER_FIELDS,
    TRAIN_FIELDS,
    array_bytes,
    model_gradients,
    split_users,
)
from fedrec_flwr.fedgnn.server import (
    FedGNNServer,
    TrainUpdate,
    check_anonymity_set,
    eval_users,
)
from fedrec_flwr.messages import NodeReply, UploadRejected
from fedrec_flwr.metrics import ErrorSums
from fedrec_flwr.models.rating_gnn import row_width
from fedrec_flwr.privacy.popularity import check_report
from fedrec_flwr.privacy_modes import privacy_mode
from fedrec_flwr.reporting.results import RunRecorder, failure_reason, report_failure, report_final, report_round

if TYPE_CHECKING:
    from fedrec_flwr.config import AppConfig
    from fedrec_flwr.fedgnn.modes.base import ServerMechanism

log = logging.getLogger("fedrec_flwr.fedgnn")


def validate_registration(arrays: list[np.ndarray], num_items: int, min_rows: int,
                          max_users: int | None = None, whole_table: bool = False) -> list[tuple[int, np.ndarray, int]]:
    """[(user, anonymity set, committed test-rating count)] of a registration message naming at most `max_users`
    users, each set checked and each count an integer in [0, set size] (a user's test items lie in its set; with
    `whole_table`, user-level DP's empty sets, in [0, num_items]); UploadRejected otherwise."""
    out = []
    for user, (ids, count) in split_users(arrays, REGISTER_FIELDS, max_users):
        ids = check_anonymity_set(ids, num_items, min_rows)
        count = np.asarray(count)
        most = num_items if whole_table else ids.size
        if count.shape != (1,) or not np.issubdtype(count.dtype, np.integer) or not 0 <= int(count[0]) <= most:
            raise UploadRejected(f"user {user}: test-rating count {count.tolist()!r}; expected one integer in "
                                 f"[0, {most}] (the user's test items lie in its anonymity set, or the catalogue)")
        out.append((user, ids, int(count[0])))
    return out


@dataclass(frozen=True)
class RoundPlan:
    """Who a round asks: its logical round and each node's users. Returned by `plan_train` / `plan_eval` and passed
    back with the replies, which are checked against it."""

    round: int
    nodes: dict[int, list[int]]


class FedGNNRounds:
    """Registration, training and evaluation rounds of one FedGNN run over a `FedGNNServer`."""

    def __init__(self, server: FedGNNServer, bindings: NodeBindings, rating_span: float, *,
                 federation: FederationConfig, privacy: PrivacyConfig, merge: MergeConfig,
                 expansion: ExpansionConfig, row_width: int, seed: int, recorder: RunRecorder | None = None,
                 public_scale: RatingScale | None = None, test_ratings: int | None = None,
                 baselines: Callable[[list[int]], tuple[dict[str, float], int]] | None = None,
                 checkpoint_every: int = 0):
        self.server, self.bindings, self.recorder = server, bindings, recorder
        # the split's test ratings (a public count; None: unknown), reported beside the ones scored, and
        # `baselines(users)`: the split's baseline RMSEs on the test ratings of `users` and how many ratings
        # that is (`baselines.baselines_on_users`; simulation only, where the server holds the data)
        self.test_ratings, self.baselines = test_ratings, baselines
        # row_width: the width of one uploaded item row (`models.row_width`), what the privacy accounting counts per row
        self.federation, self.privacy, self.expansion, self.row_width, self.seed = (federation, privacy, expansion,
                                                                                   row_width, seed)
        self.merge = merge
        # high - low of the scale the devices report in (reference units: 4, the span of the
        # participants' `PartitionMeta.scale`): bounds a reported squared error
        self.rating_span = rating_span
        # the dataset's own scale: reported RMSE and MAE are mapped back onto it (None: 1-5, no map)
        self.public_scale = public_scale
        # the privacy mode's server side: who is asked, what goes down, how uploads are checked and accounted
        self.mechanism: ServerMechanism = privacy_mode(privacy.mode).part("Server")(self)
        self.budget_rounds = self.mechanism.budget_rounds  # training rounds the privacy budget allows
        # every logical round's phase, and how Flower's rounds, resuming and checkpoints map onto them
        self.lifecycle = Lifecycle.for_run(federation, expansion, bindings.num_users,
                                           training_rounds=self.budget_rounds, first_round=self.mechanism.first_round,
                                           evaluates_in_own_rounds=self.mechanism.evaluates_in_own_rounds,
                                           checkpoint_every=checkpoint_every)
        self.train_rounds_done = 0
        self.rounds_not_applied = 0  # training rounds with fewer than min_clients accepted uploads
        self.scored_users: list[int] = []  # users of the accepted replies of the latest evaluation
        self.test_counts: dict[int, int] = {}  # user -> the test-rating count it committed at registration
        self.reported_by: dict[int, int] = {}  # user -> the node its popularity report came from (round 0)
        self.rejections: list[tuple[int, str]] = []
        self.eval_rejections = 0
        self.final: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: AppConfig, server: FedGNNServer, bindings: NodeBindings, rating_span: float,
                    recorder: RunRecorder | None = None, test_ratings: int | None = None,
                    baselines: Callable[[list[int]], tuple[dict[str, float], int]] | None = None) -> FedGNNRounds:
        """The round core of one run: its federation, privacy, merge and expansion sections, row width and seed,
        and the public rating scale of its dataset (`data.partition.public_scale`: no ratings read), on which
        it reports metrics. `test_ratings` and `baselines`: see `__init__`."""
        return cls(server, bindings, rating_span, federation=cfg.federation, privacy=cfg.privacy, merge=cfg.merge,
                   expansion=cfg.expansion, row_width=row_width(cfg.model), seed=cfg.seed, recorder=recorder,
                   public_scale=public_scale(cfg.data), test_ratings=test_ratings, baselines=baselines,
                   checkpoint_every=cfg.checkpoint.every)

    # -- bookkeeping -----------------------------------------------------------------
    @property
    def schedule(self) -> tuple[str, ...]:
        """The phase of every logical round from 1 (`Lifecycle.schedule`)."""
        return self.lifecycle.schedule

    @property
    def first_round(self) -> int:
        """The first logical round: 0 when users report popularity before registering (round 1), else 1."""
        return self.lifecycle.first_round

    def phase(self, logical_round: int) -> str:
        """The phase of a logical round (`Lifecycle.phase`)."""
        return self.lifecycle.phase(logical_round)

    def reject(self, logical_round: int, reason: str) -> None:
        """Log and count one rejected message."""
        log.warning("round %d: rejected: %s", logical_round, reason)
        self.rejections.append((logical_round, reason))

    def rejected_in(self, logical_round: int) -> int:
        """How many messages were rejected in a logical round."""
        return sum(1 for r, _ in self.rejections if r == logical_round)

    def record_expansion(self, logical_round: int, phase: str, users: int, neighbours: int, started: float) -> dict:
        """Record an expansion round in which `users` users submitted (or fetched `neighbours` neighbours in all)."""
        record = {"round": logical_round, "phase": phase, "clients": users, "accepted": users, "rejected": 0,
                  "bytes_down": 0.0, "bytes_up": 0.0, "round_seconds": time.time() - started}
        if phase == PHASE_EXPAND_FETCH:
            record["mean_neighbours"] = neighbours / max(users, 1)
        self.record(record)
        return record

    def record(self, record: dict, complete: bool = True) -> None:
        """Add one round's record to the run's results and its console line (printed once the round is
        complete: a training round that evaluates prints one line, with its evaluation)."""
        report_round(self.recorder, "fedgnn", record, complete)

    # -- popularity reports and registration ------------------------------------------
    def popularity(self, logical_round: int, replies: list[NodeReply], started: float) -> dict:
        """Check and sum the users' LDP item reports (one per user, from a node entitled to it); publish the estimate.

        The node that reports for a user is the only one that may register it (`register`), so a node
        cannot report for users it will not host.
        """
        total = np.zeros(self.server.num_items, np.int64)  # a running sum: reports are not kept
        for reply in replies:
            try:
                parts = split_users(reply.arrays, 1, self.bindings.claim_limit(reply.node_id))
                self.bindings.check_claim(reply.node_id, [u for u, _ in parts])
                checked = [(u, check_report(a[0], self.server.num_items)) for u, a in parts]
            except (UploadRejected, ValueError) as exc:
                self.reject(logical_round, f"node {reply.node_id}: popularity report refused: {exc}")
                continue
            for user, bits in checked:
                if user in self.reported_by:
                    self.reject(logical_round, f"node {reply.node_id}: a second popularity report for user {user}")
                    continue
                self.reported_by[user] = reply.node_id
                total += bits
        self.server.publish_popularity(total, len(self.reported_by))
        record = {"round": logical_round, "phase": PHASE_POPULARITY, "clients": len(replies),
                  "accepted": len(self.reported_by), "rejected": self.rejected_in(logical_round), "bytes_down": 0.0,
                  "bytes_up": float(self.server.num_items), "round_seconds": time.time() - started}
        self.record(record)
        return record

    def register(self, logical_round: int, replies: list[NodeReply], started: float) -> dict:
        """Bind each node's users and record their anonymity sets; a refused node registers nobody."""
        min_rows = self.server.min_rows()
        for reply in replies:
            try:
                claimed = validate_registration(reply.arrays, self.server.num_items, min_rows,
                                                self.bindings.claim_limit(reply.node_id),
                                                self.server.device_mechanism.whole_table)
                self.bindings.check_claim(reply.node_id, [u for u, _, _ in claimed])
                for u, _, _ in claimed:
                    if self.reported_by.get(u, reply.node_id) != reply.node_id:
                        raise UploadRejected(f"user {u} sent its popularity report from another node")
            except UploadRejected as exc:
                self.reject(logical_round, f"node {reply.node_id}: registration refused: {exc}")
                continue
            for user, ids, test_count in claimed:
                self.server.register(user, ids)
                self.test_counts[user] = test_count
            self.bindings.bind(reply.node_id, [u for u, _, _ in claimed])
        record = {"round": logical_round, "phase": PHASE_REGISTER, "clients": len(replies),
                  "accepted": len(self.server.anonymity_sets), "nodes": len(self.bindings.nodes),
                  "rejected": self.rejected_in(logical_round), "bytes_down": 0.0, "bytes_up": 0.0,
                  "round_seconds": time.time() - started}
        self.record(record)
        return record

    # -- training --------------------------------------------------------------------
    def plan_train(self, logical_round: int, connected: set[int]) -> RoundPlan:
        """The round's users (the privacy mode's `select`), grouped by the node hosting them: what `train` checks
        every reply against."""
        chosen = self.mechanism.select(logical_round, self.bindings.live_users(connected))
        return RoundPlan(logical_round, self.bindings.by_node(chosen))

    def download(self, users: list[int], weights: list[np.ndarray] | None = None,
                 table: np.ndarray | None = None) -> list[np.ndarray]:
        """One node's download: the model weights and what the privacy mode sends of the item table (the rows of its
        users' anonymity sets, or the whole table); `weights` and `table`, where given, read once for all the round's
        nodes."""
        return self.mechanism.download(users, self.server.model_weights() if weights is None else weights, table)

    def validate_reply(self, plan: RoundPlan, reply: NodeReply) -> tuple[list[TrainUpdate], int]:
        """(accepted user parts, users the reply names) of one node's training reply; refusals are counted."""
        logical_round = plan.round
        try:
            parts = split_users(reply.arrays, TRAIN_FIELDS, len(self.bindings.users_of(reply.node_id)))
        except UploadRejected as exc:
            self.reject(logical_round, f"node {reply.node_id}: {exc}")
            return [], 0
        accepted = []
        for user, arrays in parts:
            try:
                if not self.bindings.hosts(reply.node_id, user):
                    raise UploadRejected(f"user {user} is not hosted by this node")
                if user not in plan.nodes.get(reply.node_id, ()):
                    raise UploadRejected(f"user {user} was not sampled in round {logical_round}")
                self.mechanism.record_upload(user)
                flat, ids, rows = arrays
                update = self.server.validate(user, [*model_gradients(flat, self.server.model_shapes), ids, rows])
                check_upload_bounds(self.privacy, self.merge, [*update.grads, update.rows])
                accepted.append(update)
            except UploadRejected as exc:
                self.reject(logical_round, f"node {reply.node_id} user {user}: {exc}")
        return accepted, len(parts)

    def train(self, plan: RoundPlan, replies: list[NodeReply], failures: list[str], started: float,
              bytes_down: float) -> dict:
        """Validate every reply against the round's plan, apply the accepted updates (if at least min_clients),
        record the round."""
        logical_round = plan.round
        for why in failures:
            self.reject(logical_round, f"client failure: {why}")
        accepted: list[TrainUpdate] = []
        up = users_seen = 0
        for reply in replies:
            up += array_bytes(reply.arrays)
            updates, named = self.validate_reply(plan, reply)
            users_seen += named
            accepted += updates
        self.train_rounds_done += 1
        applied = len(accepted) >= self.federation.min_clients
        if applied:
            self.server.apply(accepted)
        else:
            self.rounds_not_applied += 1
            log.warning("round %d: %d accepted updates < min_clients=%d; model unchanged",
                        logical_round, len(accepted), self.federation.min_clients)
        record = {"round": logical_round, "phase": PHASE_TRAIN, "training_round": self.train_rounds_done,
                  "clients": users_seen, "accepted": len(accepted),
                  "rejected": self.rejected_in(logical_round), "failures": len(failures), "applied": applied,
                  "bytes_down": bytes_down, "bytes_up": up / max(users_seen, 1)}
        record.update(self.mechanism.train_record())
        record["round_seconds"] = time.time() - started
        self.record(record, complete=not self.evaluates_after(logical_round))
        return record

    def is_secure(self, phase: str) -> bool:
        """Whether the replies of a phase arrive as one secure sum over the nodes (SecAgg+), by the privacy mode."""
        return phase in self.mechanism.secure_phases

    def train_sum(self, logical_round: int, summed: list[np.ndarray] | None, reporting_users: int, nodes: int,
                  failures: list[str], started: float, bytes_down: float, bytes_up: float) -> dict:
        """A training round whose nodes sent one secure sum: checked, applied and accounted by the privacy mode
        (`ServerMechanism.train_sum`). `summed` None: the secure aggregation produced no sum."""
        return self.mechanism.train_sum(logical_round, summed, reporting_users, nodes, failures, started, bytes_down,
                                        bytes_up)

    # -- evaluation ------------------------------------------------------------------
    def evaluates_after(self, logical_round: int) -> bool:
        """Whether an evaluation follows the training round just done (`Lifecycle.evaluates_after`)."""
        return self.lifecycle.evaluates_after(self.train_rounds_done, logical_round)

    def unit_factor(self) -> float:
        """Reference units (what devices report) to the dataset's own scale (1 without a public scale)."""
        return 1.0 if self.public_scale is None else self.public_scale.unit_factor

    def plan_evaluate_sum(self, connected: set[int]) -> dict[int, list[int]]:
        """An evaluate-sum round: every registered user, grouped by node (every node sends a vector)."""
        return self.bindings.by_node(self.bindings.live_users(connected))

    def evaluate_sum(self, logical_round: int, summed: list[np.ndarray] | None, nodes: int, failures: list[str],
                     started: float, bytes_down: float, bytes_up: float) -> dict | None:
        """An evaluation whose nodes sent one secure sum, decoded and accounted by the privacy mode
        (`ServerMechanism.evaluate_sum`); None when no sum came or it was refused."""
        return self.mechanism.evaluate_sum(logical_round, summed, nodes, failures, started, bytes_down, bytes_up)

    def plan_eval(self, logical_round: int, connected: set[int]) -> RoundPlan:
        """The evaluating users (all, or a fixed seeded sample), grouped by node: what `evaluate` checks every reply
        against."""
        users = eval_users(self.seed, self.bindings.live_users(connected), self.federation.eval_fraction)
        return RoundPlan(logical_round, self.bindings.by_node(users))

    def check_eval_reply(self, plan: RoundPlan, reply: NodeReply) -> ErrorSums:
        """The error sums of one node's evaluation reply, or UploadRejected if no honest node could send it."""
        users = plan.nodes.get(reply.node_id)
        if users is None:
            raise UploadRejected("evaluation reply from a node that was not asked to evaluate")
        try:
            sse, sae = float(reply.metrics["sse"]), float(reply.metrics["sae"])
            n_raw = reply.metrics["n"]
        except (KeyError, TypeError, ValueError) as exc:
            raise UploadRejected(f"evaluation reply needs numeric sse, sae and n "
                                 f"({type(exc).__name__}: {exc})") from None
        if isinstance(n_raw, bool) or not isinstance(n_raw, (int, np.integer)) or n_raw < 0:
            raise UploadRejected(f"evaluation n = {n_raw!r}; expected a non-negative integer")
        n = int(n_raw)
        committed = sum(self.test_counts.get(u, 0) for u in users)
        if n != committed:  # so a node weighs exactly its users' share of the test ratings, whatever it reports
            raise UploadRejected(f"evaluation n = {n}; the node's evaluating users committed {committed} test ratings "
                                 "at registration")
        if not (math.isfinite(sse) and math.isfinite(sae)) or sse < 0 or sae < 0:
            raise UploadRejected(f"evaluation sse = {sse}, sae = {sae}; expected finite and >= 0")
        span = self.rating_span  # replies are in reference units, as the devices' ratings are
        slack = span + 1e-4 * max(span, 1.0)  # ratings may sit a rounding error outside the scale
        if sse > n * slack * slack or sae > n * slack:
            raise UploadRejected(f"evaluation sse = {sse:.4g} / sae = {sae:.4g} exceed what {n} ratings on a scale "
                                 f"of range {span:g} can give")
        return ErrorSums(sse, sae, n)

    def evaluate(self, plan: RoundPlan, replies: list[NodeReply], failures: int) -> dict | None:
        """RMSE and MAE over the accepted evaluation replies (None when no test rating was reported)."""
        logical_round = plan.round
        sse_parts, sae_parts, n = [], [], 0
        scored: list[int] = []
        for reply in replies:
            try:
                s, a, k = self.check_eval_reply(plan, reply)
            except UploadRejected as exc:
                self.eval_rejections += 1
                self.reject(logical_round, f"node {reply.node_id}: {exc}")
                continue
            sse_parts.append(s)
            sae_parts.append(a)
            n += k
            scored += plan.nodes[reply.node_id]
        if n == 0:
            log.warning("round %d: no test ratings among the %d evaluating nodes (%d failed)",
                        logical_round, len(replies), failures)
            return None
        sse, sae = math.fsum(sse_parts), math.fsum(sae_parts)  # exact: independent of arrival order
        factor = self.unit_factor()
        self.final = {"rmse": math.sqrt(sse / n) * factor, "mae": sae / n * factor, "eval_ratings": n,
                      **({} if self.test_ratings is None else {"test_ratings": self.test_ratings})}
        metrics = {**self.final, "eval_failures": failures, "eval_rejected": self.eval_rejections}
        self.scored_users = sorted(scored)
        self.record({"round": logical_round, **metrics})
        return metrics

    # -- end of run and checkpoints --------------------------------------------------
    def upload_counts(self) -> dict[str, float]:
        """How often the registered users uploaded: max, median, and the total (by the privacy mode's ledger)."""
        return self.mechanism.upload_counts()

    def privacy_budget(self) -> dict | None:
        """The budget the run has spent so far, by the privacy mode's ledger (None without one)."""
        return self.mechanism.privacy_budget()

    def failure(self) -> str | None:
        """Why the run must not report a result, or None: no training round was applied (every one had fewer
        than min_clients accepted uploads), or no evaluation scored a test rating."""
        return failure_reason(self.train_rounds_done, self.rounds_not_applied, self.federation.min_clients,
                              self.rejections, bool(self.final), "no evaluation scored a test rating")

    def finish(self) -> None:
        """Write the final metrics, rejections, upload counts, privacy budget and the baselines on the scored
        ratings; print the run summary. A run that `failure` names is marked failed instead, with no result."""
        if self.recorder is None or self.recorder.finished:
            return
        why = self.failure()
        if why is not None:
            report_failure("fedgnn", why, self.recorder.fail(why))
            return
        extra = {"rejections": [{"round": r, "reason": why} for r, why in self.rejections],
                 "eval_rejected": self.eval_rejections, "uploads_per_user": self.upload_counts(),
                 "privacy": self.privacy_budget(), "rounds_not_applied": self.rounds_not_applied}
        if self.baselines is not None:  # the model and its baselines are scored on the same test ratings
            extra["baselines"], extra["baseline_ratings"] = self.baselines(self.scored_users)
        path = self.recorder.finish(dict(self.final), extra)
        train = [h for h in self.recorder.history() if h.get("phase") == PHASE_TRAIN]
        summary = {
            **self.final, "rounds": len(train), "rounds_not_applied": self.rounds_not_applied,
            "wall_seconds": round(self.recorder.wall_seconds, 1),
            "mean_bytes_up": float(np.mean([h["bytes_up"] for h in train])) if train else 0.0,
            "mean_bytes_down": float(np.mean([h["bytes_down"] for h in train])) if train else 0.0,
            "rejected": len(self.rejections),
        }
        report_final("fedgnn", summary, path)

    def checkpoint_state(self, logical_round: int) -> dict:
        """Everything a resumed run needs besides the users' own state."""
        history = self.recorder.history() if self.recorder is not None else []
        return {**self.server.state(), "logical_round": logical_round, "train_rounds_done": self.train_rounds_done,
                "rounds_not_applied": self.rounds_not_applied,
                "history": history, "rejections": [list(r) for r in self.rejections],
                **self.mechanism.state(),
                "eval_rejected": self.eval_rejections}

    def check_resume_point(self, path, state: dict) -> None:
        """CheckpointError unless the checkpoint was written after a training round of this run's schedule, with the
        training rounds the schedule has up to there done and a privacy ledger that fits them
        (`ServerMechanism.check_resume`): a resumed run must continue the schedule and the ledger where they stopped."""
        done, trained = state["logical_round"], state["train_rounds_done"]
        self.lifecycle.check_resume_point(path, done, trained)
        self.mechanism.check_resume(path, state, trained)

    def restore(self, state: dict) -> int:
        """Continue from a checkpoint's state; returns the logical round it was written after."""
        self.server.restore(state)
        self.train_rounds_done = int(state["train_rounds_done"])
        self.rounds_not_applied = int(state["rounds_not_applied"])
        self.rejections = [(int(r), str(why)) for r, why in state["rejections"]]
        self.eval_rejections = int(state["eval_rejected"])
        self.mechanism.restore(state)
        done = int(state["logical_round"])
        if self.recorder is not None:
            self.recorder.restore_history(list(state["history"]), resumed_from=done)
        return done

