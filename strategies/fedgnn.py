"""FedGNN's server behind Flower's Strategy API: a thin adapter over `fedrec_flwr.fedgnn.rounds`.

Flower rounds map onto the run's logical rounds by the run's lifecycle (`fedgnn.lifecycle`: registration is
logical round 1; a resumed run re-registers, then continues after its checkpoint). Each Flower call turns its
messages into `NodeReply`s for the round core, which registers, samples, validates, merges, applies and records;
this class adds only what Flower needs: FitIns/EvaluateIns, node availability, the round's plan between
configure and aggregate, and the checkpoints the lifecycle asks for.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
from flwr.common import EvaluateIns, FitIns, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from fedrec_flwr.config import AppConfig, to_dict
from fedrec_flwr.fedgnn.bindings import bindings_for
from fedrec_flwr.fedgnn.checkpoint import Checkpointer, checkpoint_folder, load_resumable
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EVALUATE_SUM,
    PHASE_EXPAND_FETCH,
    PHASE_EXPAND_SUBMIT,
    PHASE_POPULARITY,
    PHASE_REGISTER,
    PHASE_TRAIN,
    ExpansionLink,
    RoundConfig,
    array_bytes,
)
from fedrec_flwr.fedgnn.rounds import FedGNNRounds, RoundPlan
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.flower.federation_size import hosted_per_node
from fedrec_flwr.messages import NodeReply
from fedrec_flwr.reporting.results import RunRecorder, records_failure
from strategies.nodes import FederationSizeError, decode_replies, wait_for_nodes

log = logging.getLogger("fedrec_flwr.fedgnn")


class FedGNNStrategy(Strategy):
    """FedGNN's server behind Flower's Strategy API: model gradients averaged, item-row gradients merged by id
    (`fedrec_flwr.fedgnn.rounds` does the work; this class adds FitIns/EvaluateIns, phases and checkpoints)."""

    def __init__(
        self, cfg: AppConfig, num_items: int, bias_init: float, recorder: RunRecorder | None = None,
        num_users: int = 0, expansion: ExpansionLink | None = None, num_item_features: int = 0, *,
        rating_span: float, test_ratings: int | None = None,
        baselines: Callable[[list[int]], tuple[dict[str, float], int]] | None = None,
    ):
        self.cfg = cfg
        self.server = FedGNNServer.from_config(cfg, num_items, bias_init, num_item_features=num_item_features)
        self.bindings = bindings_for(num_users, cfg.deployment, cfg.data.catalogue, cfg.simulation.users_per_node)
        self.recorder = recorder
        self.rounds = FedGNNRounds.from_config(cfg, self.server, self.bindings, rating_span, recorder, test_ratings,
                                               baselines)
        self.expansion = expansion
        if cfg.expansion.mode != "none" and expansion is None:
            raise ValueError(f"expansion.mode = {cfg.expansion.mode!r} needs a neighbour service link")
        self.checkpointer = Checkpointer(checkpoint_folder(cfg))
        self.lifecycle = self.rounds.lifecycle  # which logical round each Flower round is, and what it does
        self.resumed_after: int | None = None  # the logical round a resumed run's checkpoint was written after
        self.last_checkpoint = 0
        self.train_plan: RoundPlan | None = None  # from configure_fit to aggregate_fit (Flower's calls of a round)
        self.eval_plan: RoundPlan | None = None
        self.round_started = time.time()
        self.bytes_down = 0.0  # mean per user, current round
        if cfg.checkpoint.resume:
            self._resume()

    # -- rounds ------------------------------------------------------------------------
    @property
    def num_rounds(self) -> int:
        """Flower rounds this run needs (`Lifecycle.flower_rounds`: fewer when resumed)."""
        return self.lifecycle.flower_rounds(self.resumed_after)

    def logical(self, server_round: int) -> int:
        """The round of the uninterrupted run that this Flower round is (`Lifecycle.logical`)."""
        return self.lifecycle.logical(server_round, self.resumed_after)

    def phase(self, server_round: int) -> str:
        """The phase of a Flower round."""
        return self.rounds.phase(self.logical(server_round))

    @property
    def secure_phases(self) -> frozenset[str]:
        """The phases whose replies the run's privacy mode takes only as one secure sum (SecAgg+)."""
        return self.rounds.mechanism.secure_phases

    def is_secure_round(self, server_round: int) -> bool:
        """Whether this Flower round's replies must go through SecAgg+: the phases the privacy mode sums securely."""
        return self.rounds.is_secure(self.phase(server_round))

    def _resume(self) -> None:
        state = load_resumable(self.checkpointer, to_dict(self.cfg), self.server.num_items, self.bindings.num_users,
                               self.server.num_item_features)
        self.rounds.check_resume_point(self.checkpointer.path, state)
        done = self.rounds.restore(state)
        self.resumed_after = self.last_checkpoint = done
        log.info("resumed from %s after logical round %d (%d training rounds done)", self.checkpointer.folder, done,
                 self.rounds.train_rounds_done)

    def _maybe_checkpoint(self, server_round: int) -> None:
        done = self.logical(server_round)
        if not self.lifecycle.checkpoints_after(done, self.rounds.train_rounds_done):
            return
        self.checkpointer.save({**self.rounds.checkpoint_state(done), "config": to_dict(self.cfg)})
        self.last_checkpoint = done
        log.info("round %d: checkpoint written to %s", done, self.checkpointer.folder)

    def _round_config(self, server_round: int, **extra) -> dict:
        return RoundConfig(phase=self.phase(server_round), round=self.logical(server_round),
                           ckpt=self.last_checkpoint,
                           resume_from=-1 if self.resumed_after is None else self.resumed_after, **extra).to_flower()

    def _expansion(self) -> dict:
        return {"expansion": self.expansion, "retries": self.cfg.expansion.retries}

    def _registered_nodes(self, client_manager: ClientManager) -> dict[int, ClientProxy]:
        registered = set(self.bindings.nodes)
        return {c.node_id: c for c in client_manager.all().values() if c.node_id in registered}

    def _size_simulation(self, nodes: int) -> None:
        """A simulation's users per node for a federation of `nodes` SuperNodes (`simulation.users_per_node`, or with
        0 every user spread over them), or FederationSizeError at once, naming the count it needs, when they cannot
        host every user: a run never trains on, or reports for, part of the users without saying so."""
        if self.cfg.data.catalogue or self.cfg.deployment.node_list:  # a deployment: one node per user, as listed
            return
        users = self.bindings.num_users
        block = hosted_per_node(self.cfg.simulation.users_per_node, users, nodes)
        self.bindings.set_block_size(block)
        if nodes * block < users:
            need = -(-users // block)
            raise FederationSizeError(
                f"{nodes} SuperNodes host {nodes * block} of the dataset's {users} users at simulation.users_per_node "
                f"= {block}; this run needs {need}: flwr run . --federation-config \"num-supernodes={need}\" (or "
                f"fedrec run, which sizes the federation; or simulation.users_per_node=0 to spread the users over the "
                f"nodes there are)")

    # -- Flower strategy API ---------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The initial model weights (the item table stays on the server and goes out row-wise)."""
        return ndarrays_to_parameters(self.server.model_weights())

    @records_failure
    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        """Register / expand: every node. Train: the nodes of the sampled users, with their rows."""
        self.round_started = time.time()
        self.bytes_down = 0.0
        phase = self.phase(server_round)
        if phase in (PHASE_POPULARITY, PHASE_REGISTER):
            if server_round == 1:
                wait_for_nodes(client_manager, self.cfg.deployment.min_nodes, self.cfg.deployment.node_wait_seconds)
                self._size_simulation(len(client_manager.all()))
            down = self.server.registration_download() if phase == PHASE_REGISTER else []
            ins = FitIns(ndarrays_to_parameters(down), self._round_config(server_round))
            return [(c, ins) for c in client_manager.all().values()]
        nodes = self._registered_nodes(client_manager)
        if phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            ins = FitIns(ndarrays_to_parameters([]), self._round_config(server_round, **self._expansion()))
            return [(c, ins) for c in nodes.values()]
        logical = self.logical(server_round)
        if phase == PHASE_EVALUATE_SUM:  # every registered node: the model and the whole table, as in training
            payload = self.rounds.download([], self.server.model_weights())
            self.bytes_down = float(array_bytes(payload))
            ins = FitIns(ndarrays_to_parameters(payload), self._round_config(server_round))
            return [(nodes[nid], ins) for nid in self.rounds.plan_evaluate_sum(set(nodes))]
        extra = {}
        if self.lifecycle.refreshes_neighbours(logical):
            extra = {**self._expansion(), "refresh_neighbours": True}
        config = self._round_config(server_round, **extra)
        plan = self.train_plan = self.rounds.plan_train(logical, set(nodes))
        if self.is_secure_round(server_round):  # one download for every node: the model and the whole table
            payload = self.rounds.download([], self.server.model_weights())
            self.bytes_down = float(array_bytes(payload))
            ins = FitIns(ndarrays_to_parameters(payload), config)
            return [(nodes[nid], ins) for nid in plan.nodes]
        out, down, weights = [], 0, self.server.model_weights()
        for nid, users in plan.nodes.items():
            payload = self.rounds.download(users, weights)
            down += array_bytes(payload)
            out.append((nodes[nid], FitIns(ndarrays_to_parameters(payload), config)))
        self.bytes_down = down / max(sum(len(u) for u in plan.nodes.values()), 1)
        return out

    @records_failure
    def aggregate_fit(self, server_round: int, results, failures):
        """Hand the replies to the round core; rejected updates are logged and counted, never averaged in."""
        phase, logical = self.phase(server_round), self.logical(server_round)
        if phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            return self._finish_expansion(logical, phase, results, failures)
        reasons = [f"{f if isinstance(f, BaseException) else 'error result'}" for f in failures]
        if self.is_secure_round(server_round):
            return self._aggregate_secure(server_round, logical, results, reasons)
        replies = decode_replies(results, lambda why: self.rounds.reject(logical, why))
        if phase in (PHASE_POPULARITY, PHASE_REGISTER):
            for why in reasons:
                self.rounds.reject(logical, f"client failure: {why}")
            step = self.rounds.popularity if phase == PHASE_POPULARITY else self.rounds.register
            step(logical, replies, self.round_started)
            return ndarrays_to_parameters(self.server.model_weights()), {}
        record = self.rounds.train(self._plan(self.train_plan, logical), replies, reasons, self.round_started,
                                   self.bytes_down)
        if not self._is_eval_round(server_round):  # eval rounds checkpoint after their evaluation
            self._maybe_checkpoint(server_round)
        metrics = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        return ndarrays_to_parameters(self.server.model_weights()), metrics

    def _aggregate_secure(self, server_round: int, logical: int, results, reasons: list[str]):
        """A user-DP round after SecAgg+: every result carries the same unmasked mean of the nodes' vectors (each
        node reports num_examples = 1), so the sum is that mean times the number of nodes. Who reported is known
        from the bindings (what a node hosts), not from its own metrics."""
        summed, users, up = None, 0, 0.0
        reporting = sorted({proxy.node_id for proxy, _ in results})
        evaluation = self.phase(server_round) == PHASE_EVALUATE_SUM
        if results:
            try:
                mean = parameters_to_ndarrays(results[0][1].parameters)
                summed = [np.asarray(a, np.float64) * len(reporting) for a in mean]
                up = float(array_bytes(mean))
            except (ValueError, TypeError, OSError, EOFError) as exc:
                self.rounds.reject(logical, f"undecodable aggregate ({type(exc).__name__}: {exc})"[:300])
            users = sum(len(self.bindings.users_of(nid)) for nid in reporting)
        if evaluation:
            metrics = self.rounds.evaluate_sum(logical, summed, len(reporting), reasons, self.round_started,
                                               self.bytes_down, up)
            self._finish_if_last(server_round)
            return ndarrays_to_parameters(self.server.model_weights()), {
                k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
        record = self.rounds.train_sum(logical, summed, users, len(reporting), reasons, self.round_started,
                                       self.bytes_down, up)
        if not self._is_eval_round(server_round):
            self._maybe_checkpoint(server_round)
        metrics = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        return ndarrays_to_parameters(self.server.model_weights()), metrics

    def _finish_expansion(self, logical: int, phase: str, results, failures):
        """Every user must have expanded; otherwise stop: no training on half-expanded graphs."""
        if failures:
            reasons = sorted({str(f) if isinstance(f, BaseException) else "client error" for f in failures})[:3]
            raise RuntimeError(
                f"graph expansion ({phase}) failed for {len(failures)} of {len(failures) + len(results)} nodes; "
                f"stopping instead of training on half-expanded graphs: {'; '.join(reasons)}"
            )
        users = sum(int(r.metrics.get("users", r.num_examples)) for _, r in results)
        neighbours = sum(int(r.metrics.get("neighbours", 0)) for _, r in results)
        self.rounds.record_expansion(logical, phase, users, neighbours, self.round_started)
        return ndarrays_to_parameters(self.server.model_weights()), {}

    @staticmethod
    def _plan(plan: RoundPlan | None, logical: int) -> RoundPlan:
        """The plan this round's configure call made, or, without one, a plan that asked nobody (every reply is
        then refused as not asked)."""
        return plan if plan is not None and plan.round == logical else RoundPlan(logical, {})

    def _is_eval_round(self, server_round: int) -> bool:
        return self.lifecycle.evaluates_at(server_round, self.rounds.train_rounds_done, self.resumed_after)

    @records_failure
    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        """On evaluation rounds the evaluating users (all, or a fixed sample) score their own test ratings."""
        if not self._is_eval_round(server_round):
            return []
        nodes = self._registered_nodes(client_manager)
        weights, config = self.server.model_weights(), self._round_config(server_round)
        self.eval_plan = self.rounds.plan_eval(self.logical(server_round), set(nodes))
        return [(nodes[nid], EvaluateIns(ndarrays_to_parameters(self.rounds.download(users, weights)), config))
                for nid, users in self.eval_plan.nodes.items()]

    @records_failure
    def aggregate_evaluate(self, server_round: int, results, failures):
        """RMSE = sqrt(sum SSE / sum n) over the accepted replies; MAE likewise."""
        replies = [NodeReply(proxy.node_id, metrics=dict(res.metrics)) for proxy, res in results]
        metrics = self.rounds.evaluate(self._plan(self.eval_plan, self.logical(server_round)), replies, len(failures))
        if self.phase(server_round) == PHASE_TRAIN:
            self._maybe_checkpoint(server_round)
        self._finish_if_last(server_round)
        return (None, {}) if metrics is None else (metrics["rmse"], metrics)

    def _finish_if_last(self, server_round: int) -> None:
        """After the run's last round: write the results, and have the neighbour service forget the run."""
        if server_round == self.num_rounds:
            self.rounds.finish()
            if self.expansion is not None and self.expansion.close_run is not None:
                self.expansion.close_run()  # the neighbour service forgets this run's embeddings now

    def evaluate(self, server_round: int, parameters: Parameters):
        """No server-side evaluation: the server holds no ratings."""
        return None
