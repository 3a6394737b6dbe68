"""FedAvg with pseudo-item gradient merging (FedGNN's server) behind Flower's Strategy API.

Round 1 registers every user's anonymity set (item ids only). Every later round:
1. sample users (seeded, by user id), send each node the model weights and the item rows of
   the anonymity sets of its sampled users;
2. validate each user's upload, reject malformed ones (logged, counted, never averaged in);
3. average model gradients over the |S| accepted users, merge item-row gradients by item id
   (sum / |S| as in the paper, or sum / per-item count), and apply the server optimiser;
4. every `eval_every` rounds, users report (SSE, n) on their own test ratings -> RMSE.

Checkpoints: every `checkpoint.every` training rounds the server state is saved; a run with
`checkpoint.resume` re-registers the users and continues from the saved logical round, so its
round numbers, sampling and client randomness are those of the uninterrupted run.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.common import EvaluateIns, FitIns, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from fedrec_flwr.config import AppConfig, to_dict
from fedrec_flwr.protocol import (
    PHASE_EXPAND_FETCH, PHASE_EXPAND_SUBMIT, PHASE_REGISTER, PHASE_TRAIN, UploadRejected, array_bytes,
    frame_download, split_upload,
)
from fedrec_flwr.results import RunRecorder, report_round
from strategies.nodes import wait_for_nodes
from strategies.fedgnn_server import FedGNNServer, TrainUpdate, check_ids, eval_users, round_schedule, sample_users

log = logging.getLogger("fedrec_flwr.fedgnn")


def validate_registration(arrays: list[np.ndarray], num_items: int, min_rows: int) -> list[tuple[int, np.ndarray]]:
    """[(user, anonymity set)] of a registration message, each set checked; UploadRejected otherwise."""
    return [(u, check_ids(a[0], num_items, min_rows)) for u, a in split_upload(arrays, 1)]


@dataclass(frozen=True)
class ExpansionLink:
    """What the server hands clients for graph expansion: the token key and where the service is."""

    key: bytes
    address: str
    run_id: str


# config keys that may differ between a killed run and its resumption
_RESUME_FREE = ("checkpoint", "output_dir", "faults")


class FedGNNStrategy(FedAvg):
    """FedAvg over model gradients with item-row gradients merged by id (FedGNN's server)."""

    def __init__(
        self, cfg: AppConfig, num_items: int, bias_init: float, recorder: RunRecorder | None = None,
        num_users: int = 0, expansion: ExpansionLink | None = None, num_item_features: int = 0, **kwargs,
    ):
        super().__init__(
            min_fit_clients=1,
            min_evaluate_clients=1,
            min_available_clients=1,
            accept_failures=True,
            **kwargs,
        )
        self.cfg = cfg
        self.num_items = num_items
        self.server = FedGNNServer(cfg, num_items, bias_init, num_item_features=num_item_features)
        self.node_users: dict[int, list[int]] = {}  # node id -> the users it registered
        self.user_node: dict[int, int] = {}
        self.recorder = recorder
        self.round_started = time.time()
        self.bytes_down = 0.0  # mean per user, current round
        self.rejections: list[tuple[int, str]] = []
        self.final: dict[str, float] = {}
        self.schedule = round_schedule(cfg, num_users)
        self.expansion = expansion
        if cfg.expansion.mode != "none" and expansion is None:
            raise ValueError(f"expansion.mode = {cfg.expansion.mode!r} needs a neighbour service link")
        self.train_rounds_done = 0
        self.offset = 0  # logical round = Flower round + offset (after registration)
        self.resumed_from = -1
        self.last_checkpoint = 0
        self.checkpoint_dir = Path(cfg.checkpoint.dir or Path(cfg.output_dir) / "checkpoint")
        if cfg.checkpoint.resume:
            self._resume()

    # -- rounds ------------------------------------------------------------------------
    def model_weights(self) -> list[np.ndarray]:
        """Current model weights as numpy arrays."""
        return self.server.model_weights()

    @property
    def num_rounds(self) -> int:
        """Flower rounds this run needs (registration, training, expansion; fewer when resumed)."""
        return len(self.schedule) - self.offset

    def logical(self, server_round: int) -> int:
        """The round of the uninterrupted run that this Flower round is (registration is always 1)."""
        return 1 if server_round == 1 else server_round + self.offset

    def phase(self, server_round: int) -> str:
        """The phase of a Flower round."""
        return self.schedule[self.logical(server_round) - 1]

    def _resume(self) -> None:
        ckpt = self.server.read_checkpoint(self.checkpoint_dir)
        now = {k: v for k, v in to_dict(self.cfg).items() if k not in _RESUME_FREE}
        then = {k: v for k, v in ckpt["config"].items() if k not in _RESUME_FREE}
        if now != then:
            diff = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
            raise ValueError(f"checkpoint {self.checkpoint_dir} was written with a different config (sections {diff})")
        self.server.restore(ckpt)
        done = int(ckpt["logical_round"])
        self.offset = done - 1
        self.resumed_from = self.last_checkpoint = done
        self.train_rounds_done = int(ckpt["train_rounds_done"])
        self.rejections = [tuple(r) for r in ckpt["rejections"]]
        if self.recorder is not None:
            self.recorder.doc["rounds"] = list(ckpt["history"])
            self.recorder.doc["resumed_from"] = done
        print(f"[fedgnn] resumed from {self.checkpoint_dir} after logical round {done} "
              f"({self.train_rounds_done} training rounds done)", flush=True)

    def _maybe_checkpoint(self, server_round: int) -> None:
        every = self.cfg.checkpoint.every
        if not every or self.phase(server_round) != PHASE_TRAIN or self.train_rounds_done % every:
            return
        done = self.logical(server_round)
        history = list(self.recorder.doc["rounds"]) if self.recorder is not None else []
        self.server.save_checkpoint(self.checkpoint_dir, {
            "logical_round": done, "train_rounds_done": self.train_rounds_done, "history": history,
            "rejections": self.rejections, "config": to_dict(self.cfg),
        })
        self.last_checkpoint = done
        log.info("round %d: checkpoint written to %s", done, self.checkpoint_dir)

    def _base_config(self, server_round: int) -> dict:
        return {"phase": self.phase(server_round), "round": self.logical(server_round),
                "ckpt": self.last_checkpoint, "resume_from": self.resumed_from}

    def _expansion_config(self) -> dict:
        link = self.expansion
        return {"nb_key": link.key, "nb_address": link.address, "nb_run": link.run_id,
                "nb_retries": self.cfg.expansion.retries}

    def _registered_nodes(self, client_manager: ClientManager) -> dict[int, ClientProxy]:
        return {c.node_id: c for c in client_manager.all().values() if c.node_id in self.node_users}

    def _live_users(self, nodes: dict[int, ClientProxy]) -> list[int]:
        """Registered users whose node is connected now."""
        return [u for u in self.server.registry if self.user_node.get(u) in nodes]

    def _by_node(self, users: list[int]) -> dict[int, list[int]]:
        """The users grouped by the node hosting them (one message per node)."""
        grouped: dict[int, list[int]] = {}
        for u in users:
            grouped.setdefault(self.user_node[u], []).append(u)
        return grouped

    def _framed(self, weights: list[np.ndarray], users: list[int]) -> list[np.ndarray]:
        return frame_download(weights, users, [self.server.rows_for(u) for u in users])

    # -- Flower strategy API ---------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The initial model weights (the item table stays on the server and goes out row-wise)."""
        return ndarrays_to_parameters(self.server.model_weights())

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        """Register / expand: every node. Train: the nodes of the sampled users, with their rows."""
        self.round_started = time.time()
        phase = self.phase(server_round)
        config = self._base_config(server_round)
        if phase == PHASE_REGISTER:
            wait_for_nodes(client_manager, self.cfg.federation.min_nodes, self.cfg.federation.node_wait_seconds)
            self.bytes_down = 0.0
            ins = FitIns(ndarrays_to_parameters([]), config)
            return [(c, ins) for c in client_manager.all().values()]
        nodes = self._registered_nodes(client_manager)
        if phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            self.bytes_down = 0.0
            ins = FitIns(ndarrays_to_parameters([]), {**config, **self._expansion_config()})
            return [(c, ins) for c in nodes.values()]
        chosen = sample_users(self.cfg.seed, self.logical(server_round), self._live_users(nodes),
                              self.cfg.federation.clients_per_round)
        if self.cfg.expansion.mode == "trainable" and PHASE_EXPAND_FETCH in self.schedule[: self.logical(server_round) - 1]:
            config.update(self._expansion_config(), nb_refresh=True)
        out, down, weights = [], 0, self.server.model_weights()
        for nid, users in self._by_node(chosen).items():
            payload = self._framed(weights, users)
            down += array_bytes(payload)
            out.append((nodes[nid], FitIns(ndarrays_to_parameters(payload), config)))
        self.bytes_down = down / max(len(chosen), 1)
        return out

    def aggregate_fit(self, server_round: int, results, failures):
        """Validate, merge and apply; rejected updates are logged and counted, never averaged in."""
        phase = self.phase(server_round)
        if phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            return self._finish_expansion(server_round, phase, results, failures)
        for f in failures:
            self._reject(server_round, f"client failure: {f if isinstance(f, BaseException) else 'error result'}")
        if phase == PHASE_REGISTER:
            return self._finish_registration(server_round, results, failures)
        accepted: list[TrainUpdate] = []
        up = users_seen = 0
        per_user = len(self.server.model_shapes) + 2
        for proxy, res in results:
            arrays = parameters_to_ndarrays(res.parameters)
            up += array_bytes(arrays)
            try:
                parts = split_upload(arrays, per_user)
            except UploadRejected as exc:
                self._reject(server_round, f"node {proxy.node_id}: {exc}")
                continue
            users_seen += len(parts)
            for user, user_arrays in parts:
                try:
                    if self.user_node.get(user) != proxy.node_id:
                        raise UploadRejected(f"user {user} is not hosted by this node")
                    accepted.append(self.server.validate(user, user_arrays))
                except UploadRejected as exc:
                    self._reject(server_round, f"node {proxy.node_id} user {user}: {exc}")
        self.train_rounds_done += 1
        min_clients = self.cfg.federation.min_clients
        if len(accepted) >= min_clients:
            self.server.apply(accepted)
        else:
            log.warning("round %d: %d accepted updates < min_clients=%d; model unchanged",
                        self.logical(server_round), len(accepted), min_clients)
        record = {
            "round": self.logical(server_round), "phase": phase, "clients": users_seen, "accepted": len(accepted),
            "rejected": len(self.rejections_in(server_round)), "failures": len(failures),
            "applied": len(accepted) >= min_clients,
            "bytes_down": self.bytes_down, "bytes_up": up / max(users_seen, 1),
        }
        if self.cfg.privacy.ldp:
            record["epsilon"] = 2 * self.cfg.privacy.clip_delta / self.cfg.privacy.noise_lambda
        record["round_seconds"] = time.time() - self.round_started
        self._record(record)
        self._maybe_checkpoint(server_round)
        return ndarrays_to_parameters(self.server.model_weights()), {k: v for k, v in record.items() if isinstance(v, (int, float))}

    def rejections_in(self, server_round: int) -> list[str]:
        """Reasons of the updates rejected in a (Flower) round."""
        r = self.logical(server_round)
        return [why for rnd, why in self.rejections if rnd == r]

    def _finish_registration(self, server_round: int, results, failures):
        """Record each node's users and their anonymity sets; a user claimed twice is refused."""
        for proxy, res in results:
            try:
                claimed = validate_registration(parameters_to_ndarrays(res.parameters), self.num_items, self.server.min_rows())
                for user, _ in claimed:
                    if user in self.user_node and self.user_node[user] != proxy.node_id:
                        raise UploadRejected(f"user {user} is already registered by another node")
            except UploadRejected as exc:
                self._reject(server_round, f"node {proxy.node_id}: registration refused: {exc}")
                continue
            for user, ids in claimed:
                self.server.register(user, ids)
                self.user_node[user] = proxy.node_id
            self.node_users[proxy.node_id] = [u for u, _ in claimed]
        record = {"round": self.logical(server_round), "phase": PHASE_REGISTER, "clients": len(results),
                  "accepted": len(self.server.registry), "nodes": len(self.node_users),
                  "rejected": len(self.rejections_in(server_round)), "bytes_down": 0.0, "bytes_up": 0.0,
                  "round_seconds": time.time() - self.round_started}
        self._record(record)
        return ndarrays_to_parameters(self.server.model_weights()), {}

    def _finish_expansion(self, server_round: int, phase: str, results, failures):
        """Every user must have expanded; otherwise stop: no training on half-expanded graphs."""
        if failures:
            reasons = sorted({str(f) if isinstance(f, BaseException) else "client error" for f in failures})[:3]
            raise RuntimeError(
                f"graph expansion ({phase}) failed for {len(failures)} of {len(failures) + len(results)} nodes; "
                f"stopping instead of training on half-expanded graphs: {'; '.join(reasons)}"
            )
        users = sum(int(r.metrics.get("users", r.num_examples)) for _, r in results)
        record = {"round": self.logical(server_round), "phase": phase, "clients": users, "accepted": users,
                  "rejected": 0, "bytes_down": 0.0, "bytes_up": 0.0, "round_seconds": time.time() - self.round_started}
        if phase == PHASE_EXPAND_FETCH:
            record["mean_neighbours"] = sum(int(r.metrics.get("neighbours", 0)) for _, r in results) / max(users, 1)
        self._record(record)
        return ndarrays_to_parameters(self.server.model_weights()), {}

    def _reject(self, server_round: int, reason: str) -> None:
        log.warning("round %d: rejected update: %s", self.logical(server_round), reason)
        self.rejections.append((self.logical(server_round), reason))

    def _is_eval_round(self, server_round: int) -> bool:
        if self.phase(server_round) != PHASE_TRAIN:
            # a run resumed from its last training round (killed during the final evaluation) only
            # re-registers the users, then evaluates
            return self.resumed_from >= 0 and server_round == self.num_rounds and self.train_rounds_done > 0
        r = self.train_rounds_done
        return r > 0 and (r % self.cfg.federation.eval_every == 0 or server_round == self.num_rounds)

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        """On evaluation rounds the evaluating users (all, or a fixed sample) score their own test ratings."""
        if not self._is_eval_round(server_round):
            return []
        nodes = self._registered_nodes(client_manager)
        evaluating = eval_users(self.cfg.seed, self._live_users(nodes), self.cfg.federation.eval_fraction)
        weights, config = self.server.model_weights(), self._base_config(server_round)
        return [(nodes[nid], EvaluateIns(ndarrays_to_parameters(self._framed(weights, users)), config))
                for nid, users in self._by_node(evaluating).items()]

    def aggregate_evaluate(self, server_round: int, results, failures):
        """RMSE = sqrt(sum SSE / sum n) over users; MAE likewise."""
        sse = math.fsum(float(r.metrics.get("sse", 0.0)) for _, r in results)  # exact: independent of arrival order
        sae = math.fsum(float(r.metrics.get("sae", 0.0)) for _, r in results)
        n = sum(int(r.metrics.get("n", 0)) for _, r in results)
        if n == 0:
            log.warning("round %d: no test ratings among the %d evaluating nodes (%d failed)",
                        self.logical(server_round), len(results), len(failures))
            if server_round == self.num_rounds:
                self.finish()
            return None, {}
        metrics = {"rmse": float(np.sqrt(sse / n)), "mae": sae / n, "eval_ratings": n, "eval_failures": len(failures)}
        self.final = {"rmse": metrics["rmse"], "mae": metrics["mae"]}
        self._record({"round": self.logical(server_round), **metrics})
        if server_round == self.num_rounds:
            self.finish()
        return metrics["rmse"], metrics

    def finish(self) -> None:
        """Write the final metrics and print the run summary."""
        if self.recorder is None or self.recorder.doc["status"] == "finished":
            return
        extra = {"rejections": [{"round": r, "reason": why} for r, why in self.rejections]}
        path = self.recorder.finish(dict(self.final), extra)
        train = [h for h in self.recorder.doc["rounds"] if h.get("phase") == PHASE_TRAIN]
        summary = {
            **self.final,
            "rounds": len(train),
            "wall_seconds": round(self.recorder.doc["wall_seconds"], 1),
            "mean_bytes_up": float(np.mean([h["bytes_up"] for h in train])) if train else 0.0,
            "mean_bytes_down": float(np.mean([h["bytes_down"] for h in train])) if train else 0.0,
            "rejected": len(self.rejections),
        }
        print(f"[fedgnn] FINAL {summary} results: {path}", flush=True)

    def evaluate(self, server_round: int, parameters: Parameters):
        """No server-side evaluation: the server holds no ratings."""
        return None

    def _record(self, record: dict) -> None:
        report_round(self.recorder, "fedgnn", record)
