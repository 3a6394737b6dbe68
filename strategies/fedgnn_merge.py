"""FedAvg with pseudo-item gradient merging (FedGNN), plus registration and federated RMSE.

Round 1 registers every user's anonymity set (item ids only). Every later round:
1. sample users, send each the model weights and the item rows of its own anonymity set;
2. validate each upload, reject malformed ones (logged, counted, never averaged in);
3. average model gradients over the |S| accepted users, merge item-row gradients by item id
   (sum / |S| as in the paper, or sum / per-item count), and apply the server optimiser;
4. every `eval_every` rounds, users report (SSE, n) on their own test ratings -> RMSE.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from fedrec_flwr.config import AppConfig
from fedrec_flwr.models import build_model
from fedrec_flwr.protocol import (
    PHASE_EXPAND_FETCH, PHASE_EXPAND_SUBMIT, PHASE_REGISTER, PHASE_TRAIN, UploadRejected, array_bytes,
)
from fedrec_flwr.results import RunRecorder, report_round

log = logging.getLogger("fedrec_flwr.fedgnn")


def validate_registration(arrays: list[np.ndarray], num_items: int, min_rows: int) -> np.ndarray:
    """The anonymity set of a registration message, checked: sorted unique in-range ids, >= min_rows."""
    if len(arrays) != 1:
        raise UploadRejected(f"registration must carry exactly 1 array (item ids), got {len(arrays)}")
    return _check_ids(arrays[0], num_items, min_rows)


def _check_ids(ids: np.ndarray, num_items: int, min_rows: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UploadRejected(f"item ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size < min_rows:
        raise UploadRejected(f"upload has {ids.size} item rows, fewer than the required {min_rows}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_items):
        raise UploadRejected(f"item id out of range [0, {num_items})")
    if np.unique(ids).size != ids.size:
        raise UploadRejected("duplicate item ids")
    return ids.astype(np.int64)


def validate_upload(
    arrays: list[np.ndarray], model_shapes: list[tuple[int, ...]], dim: int, num_items: int, min_rows: int,
    registered: np.ndarray | None,
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Split and check a training upload: (model grads, item ids, item rows) or UploadRejected."""
    n = len(model_shapes)
    if len(arrays) != n + 2:
        raise UploadRejected(f"expected {n + 2} arrays (model grads, ids, rows), got {len(arrays)}")
    grads = []
    for i, (a, shape) in enumerate(zip(arrays[:n], model_shapes)):
        a = np.asarray(a)
        if a.shape != shape:
            raise UploadRejected(f"model gradient {i} has shape {a.shape}, expected {shape}")
        if not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
            raise UploadRejected(f"model gradient {i} has NaN/Inf or a non-float dtype")
        grads.append(a.astype(np.float32))
    ids = _check_ids(arrays[n], num_items, min_rows)
    rows = np.asarray(arrays[n + 1])
    if rows.shape != (ids.size, dim):
        raise UploadRejected(f"item rows have shape {rows.shape}, expected {(ids.size, dim)}")
    if not np.issubdtype(rows.dtype, np.floating) or not np.isfinite(rows).all():
        raise UploadRejected("item rows have NaN/Inf or a non-float dtype")
    if registered is not None and not np.array_equal(ids, registered):
        raise UploadRejected("item ids differ from the anonymity set the client registered")
    return grads, ids, rows.astype(np.float32)


def merge_item_gradients(
    uploads: list[tuple[np.ndarray, np.ndarray]], num_items: int, dim: int, normalise: str
) -> tuple[np.ndarray, np.ndarray]:
    """(touched ids, merged rows): per-item sum divided by |S| ("clients") or by its count ("count")."""
    total = torch.zeros((num_items, dim), dtype=torch.float64)
    count = np.zeros(num_items, np.int64)
    for ids, rows in uploads:  # ids are unique within an upload (validated)
        total.index_add_(0, torch.from_numpy(ids), torch.from_numpy(rows).double())
        count[ids] += 1
    total = total.numpy()
    touched = np.flatnonzero(count)
    denom = count[touched][:, None] if normalise == "count" else max(len(uploads), 1)
    return touched, (total[touched] / denom).astype(np.float32)


@dataclass(frozen=True)
class ExpansionLink:
    """What the server hands clients for graph expansion: the token key and where the service is."""

    key: bytes
    address: str
    run_id: str


def round_schedule(cfg: AppConfig, num_users: int) -> list[str]:
    """Phase of every Flower round: register, training rounds, and (once, after T epochs) expansion.

    One epoch is ceil(users / clients_per_round) training rounds. Expansion is two rounds in which
    every user first submits to the neighbour service, then fetches its neighbours.
    """
    rounds = cfg.federation.rounds
    phases = [PHASE_REGISTER] + [PHASE_TRAIN] * rounds
    if cfg.expansion.mode != "none":
        per_epoch = -(-num_users // cfg.federation.clients_per_round)
        after = cfg.expansion.epoch * per_epoch
        if after >= rounds:
            raise ValueError(
                f"expansion.epoch = {cfg.expansion.epoch} puts graph expansion after training round {after}, "
                f"but federation.rounds = {rounds}; lower the epoch or add rounds"
            )
        phases[1 + after : 1 + after] = [PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH]
    return phases


@dataclass
class ServerState:
    """What the recommendation server holds: model, item table, optimiser and the registry of anonymity sets."""

    model: torch.nn.Module
    items: torch.nn.Parameter
    registry: dict[int, np.ndarray] = field(default_factory=dict)


class FedGNNStrategy(FedAvg):
    """FedAvg over model gradients with item-row gradients merged by id (FedGNN's server)."""

    def __init__(
        self, cfg: AppConfig, num_items: int, bias_init: float, recorder: RunRecorder | None = None,
        num_users: int = 0, expansion: ExpansionLink | None = None, **kwargs,
    ):
        super().__init__(
            min_fit_clients=cfg.federation.min_clients,
            min_evaluate_clients=1,
            min_available_clients=cfg.federation.min_clients,
            accept_failures=True,
            **kwargs,
        )
        self.cfg = cfg
        self.num_items = num_items
        torch.manual_seed(cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.state = ServerState(
            model=build_model(cfg.model, bias_init),
            items=torch.nn.Parameter(torch.randn(num_items, cfg.model.dim, generator=gen) * 0.1),
        )
        params = list(self.state.model.parameters())
        so = cfg.server_opt
        if so.name == "adam":
            self.model_opt = torch.optim.Adam(params, lr=so.lr)
            self.item_opt = torch.optim.SparseAdam([self.state.items], lr=so.lr)
        else:
            self.model_opt = torch.optim.SGD(params, lr=so.lr, momentum=so.momentum)
            self.item_opt = torch.optim.SGD([self.state.items], lr=so.lr)
        self.model_shapes = [tuple(p.shape) for p in params]
        self.recorder = recorder
        self.round_started = time.time()
        self.bytes_down = 0.0  # mean per client, current round
        self.rejections: list[tuple[int, str]] = []
        self.final: dict[str, float] = {}
        self.schedule = round_schedule(cfg, num_users)
        self.expansion = expansion
        if cfg.expansion.mode != "none" and expansion is None:
            raise ValueError(f"expansion.mode = {cfg.expansion.mode!r} needs a neighbour service link")
        self.train_rounds_done = 0

    @property
    def num_rounds(self) -> int:
        """Flower rounds this strategy needs (registration, training, expansion)."""
        return len(self.schedule)

    def phase(self, server_round: int) -> str:
        """The phase of a Flower round."""
        return self.schedule[server_round - 1]

    def _expansion_config(self) -> dict:
        link = self.expansion
        return {"nb_key": link.key, "nb_address": link.address, "nb_run": link.run_id,
                "nb_retries": self.cfg.expansion.retries}

    # -- helpers ---------------------------------------------------------------------
    def model_weights(self) -> list[np.ndarray]:
        """Current model weights as numpy arrays."""
        return [p.detach().numpy().copy() for p in self.state.model.parameters()]

    def _rows_for(self, node_id: int) -> np.ndarray:
        return self.state.items.detach()[torch.from_numpy(self.state.registry[node_id])].numpy()

    def _payload(self, node_id: int, weights: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Model weights (pass them in to copy them once per round) and the node's anonymity-set rows."""
        return [*(weights if weights is not None else self.model_weights()), self._rows_for(node_id)]

    def _min_rows(self) -> int:
        """Rows every upload must carry: M, or the whole catalogue when it has fewer than M items."""
        return min(self.cfg.privacy.pseudo_items, self.num_items)

    # -- Flower strategy API ---------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The initial model weights (the item table stays on the server and goes out row-wise)."""
        return ndarrays_to_parameters(self.model_weights())

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        """Register / expand: every client. Train: sampled clients get weights + their own rows."""
        self.round_started = time.time()
        phase = self.phase(server_round)
        if phase == PHASE_REGISTER:
            ins = FitIns(ndarrays_to_parameters([]), {"phase": phase, "round": server_round})
            self.bytes_down = 0.0
            return [(c, ins) for c in client_manager.all().values()]
        registered = [c for c in client_manager.all().values() if c.node_id in self.state.registry]
        if phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            ins = FitIns(ndarrays_to_parameters([]), {"phase": phase, "round": server_round, **self._expansion_config()})
            self.bytes_down = 0.0
            return [(c, ins) for c in registered]
        k = min(self.cfg.federation.clients_per_round, len(registered))
        rng = np.random.default_rng([self.cfg.seed, server_round])
        chosen = [registered[i] for i in rng.choice(len(registered), size=k, replace=False)]
        config: dict = {"phase": PHASE_TRAIN, "round": server_round}
        if self.cfg.expansion.mode == "trainable" and PHASE_EXPAND_FETCH in self.schedule[: server_round - 1]:
            config.update(self._expansion_config(), nb_refresh=True)
        out, down, weights = [], 0, self.model_weights()
        for c in chosen:
            payload = self._payload(c.node_id, weights)
            down += array_bytes(payload)
            out.append((c, FitIns(ndarrays_to_parameters(payload), config)))
        self.bytes_down = down / max(len(out), 1)
        return out

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures):
        """Validate, merge and apply; rejected updates are logged and counted, never averaged in."""
        phase = self.phase(server_round)
        if phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            return self._finish_expansion(server_round, phase, results, failures)
        for f in failures:
            self._reject(server_round, f"client failure: {f if isinstance(f, BaseException) else 'error result'}")
        accepted: list[tuple[list[np.ndarray], np.ndarray, np.ndarray]] = []
        up = 0
        for proxy, res in results:
            arrays = parameters_to_ndarrays(res.parameters)
            up += array_bytes(arrays)
            try:
                if phase == PHASE_REGISTER:
                    self.state.registry[proxy.node_id] = validate_registration(arrays, self.num_items, self._min_rows())
                    continue
                accepted.append(
                    validate_upload(
                        arrays, self.model_shapes, self.cfg.model.dim, self.num_items,
                        self._min_rows(), self.state.registry.get(proxy.node_id),
                    )
                )
            except UploadRejected as exc:
                self._reject(server_round, f"node {proxy.node_id}: {exc}")
        record = {
            "round": server_round,
            "phase": phase,
            "clients": len(results),
            "accepted": len(accepted) if phase == PHASE_TRAIN else len(self.state.registry),
            "rejected": len(failures) + len(results) - (len(accepted) if phase == PHASE_TRAIN else len(self.state.registry)),
            "bytes_down": self.bytes_down,
            "bytes_up": up / max(len(results), 1),
        }
        if phase == PHASE_TRAIN:
            self.train_rounds_done += 1
        if accepted and len(accepted) >= self.cfg.federation.min_clients:
            self._apply(accepted)
        elif phase == PHASE_TRAIN:
            log.warning("round %d: %d accepted updates < min_clients=%d; model unchanged",
                        server_round, len(accepted), self.cfg.federation.min_clients)
        if self.cfg.privacy.ldp:
            record["epsilon"] = 2 * self.cfg.privacy.clip_delta / self.cfg.privacy.noise_lambda
        record["round_seconds"] = time.time() - self.round_started
        self._record(record)
        return ndarrays_to_parameters(self.model_weights()), {k: v for k, v in record.items() if isinstance(v, (int, float))}

    def _finish_expansion(self, server_round: int, phase: str, results, failures):
        """Every user must have expanded; otherwise stop: no training on half-expanded graphs."""
        if failures:
            reasons = sorted({str(f) if isinstance(f, BaseException) else "client error" for f in failures})[:3]
            raise RuntimeError(
                f"graph expansion ({phase}) failed for {len(failures)} of {len(failures) + len(results)} users; "
                f"stopping instead of training on half-expanded graphs: {'; '.join(reasons)}"
            )
        record = {"round": server_round, "phase": phase, "clients": len(results), "accepted": len(results),
                  "rejected": 0, "bytes_down": 0.0, "bytes_up": 0.0, "round_seconds": time.time() - self.round_started}
        if phase == PHASE_EXPAND_FETCH:
            counts = [int(r.metrics.get("neighbours", 0)) for _, r in results]
            record["mean_neighbours"] = float(np.mean(counts)) if counts else 0.0
        self._record(record)
        return ndarrays_to_parameters(self.model_weights()), {}

    def _apply(self, accepted: list[tuple[list[np.ndarray], np.ndarray, np.ndarray]]) -> None:
        s = len(accepted)
        self.model_opt.zero_grad()
        for p, i in zip(self.state.model.parameters(), range(len(self.model_shapes))):
            p.grad = torch.from_numpy(np.asarray(sum(a[0][i] for a in accepted) / s, np.float32)).reshape(p.shape)
        self.model_opt.step()
        uploads = [(a[1], a[2] - a[2].mean(0) if self.cfg.federation.center_uploads else a[2]) for a in accepted]
        ids, rows = merge_item_gradients(uploads, self.num_items, self.cfg.model.dim, self.cfg.federation.item_merge)
        self.item_opt.zero_grad()
        grad = torch.sparse_coo_tensor(torch.from_numpy(ids)[None, :], torch.from_numpy(rows), self.state.items.shape)
        if isinstance(self.item_opt, torch.optim.SparseAdam):
            self.state.items.grad = grad.coalesce()
        else:
            self.state.items.grad = grad.to_dense()
        self.item_opt.step()

    def _reject(self, server_round: int, reason: str) -> None:
        log.warning("round %d: rejected update: %s", server_round, reason)
        self.rejections.append((server_round, reason))

    def _is_eval_round(self, server_round: int) -> bool:
        if self.phase(server_round) != PHASE_TRAIN:
            return False
        r = self.train_rounds_done
        return r > 0 and (r % self.cfg.federation.eval_every == 0 or server_round == self.num_rounds)

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        """On evaluation rounds every registered user evaluates on its own test ratings."""
        if not self._is_eval_round(server_round):
            return []
        weights = self.model_weights()
        return [
            (c, EvaluateIns(ndarrays_to_parameters(self._payload(c.node_id, weights)), {"round": server_round}))
            for c in client_manager.all().values()
            if c.node_id in self.state.registry
        ]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures):
        """RMSE = sqrt(sum SSE / sum n) over users; MAE likewise."""
        sse = sum(float(r.metrics.get("sse", 0.0)) for _, r in results)
        sae = sum(float(r.metrics.get("sae", 0.0)) for _, r in results)
        n = sum(int(r.metrics.get("n", 0)) for _, r in results)
        if n == 0:
            return None, {}
        metrics = {"rmse": float(np.sqrt(sse / n)), "mae": sae / n, "eval_ratings": n, "eval_failures": len(failures)}
        self.final = {"rmse": metrics["rmse"], "mae": metrics["mae"]}
        self._record({"round": server_round, **metrics})
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
