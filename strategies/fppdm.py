"""FPPDM's server: Wasserstein barycenter of the overlapping users' Gaussians across domains.

Every round all domains train and upload (global user ids, mu, sigma) of their users; the
server validates each upload (rejects, logs and counts malformed ones), computes the closed-form
barycenter per user over the domains where it appears, and sends each domain the global
distributions of its own users. Evaluation: each domain reports HR@K/NDCG@K on its own
leave-one-out test users; the server keeps them per domain and their mean.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from flwr.common import EvaluateIns, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg

from fedrec_flwr.fppdm.barycenter import user_barycenters
from fedrec_flwr.config import AppConfig
from fedrec_flwr.privacy.paillier_pack import FixedPointPacker, ciphertexts_to_array
from fedrec_flwr.messages import UploadRejected, array_bytes
from strategies.nodes import wait_for_nodes
from fedrec_flwr.fppdm.secure_barycenter import per_user_ciphertexts, sum_encrypted
from fedrec_flwr.results import RunRecorder, report_round

log = logging.getLogger("fedrec_flwr.fppdm")


def validate_distributions(arrays: list[np.ndarray], num_users: int, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, mu, sigma) of a domain upload, or UploadRejected naming what is wrong."""
    if len(arrays) != 3:
        raise UploadRejected(f"expected 3 arrays (user ids, mu, sigma), got {len(arrays)}")
    ids, mu, sigma = (np.asarray(a) for a in arrays)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UploadRejected("user ids must be a 1-D integer array")
    if ids.size and (ids.min() < 0 or ids.max() >= num_users):
        raise UploadRejected(f"user id out of range [0, {num_users})")
    if np.unique(ids).size != ids.size:
        raise UploadRejected("duplicate user ids")
    for name, a in (("mu", mu), ("sigma", sigma)):
        if a.shape != (ids.size, dim):
            raise UploadRejected(f"{name} has shape {a.shape}, expected {(ids.size, dim)}")
        if not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
            raise UploadRejected(f"{name} has NaN/Inf or a non-float dtype")
    if (sigma < 0).any():
        raise UploadRejected("sigma must be non-negative (positive for Gaussians, zero for point embeddings)")
    return ids.astype(np.int64), mu.astype(np.float32), sigma.astype(np.float32)


def validate_encrypted(arrays: list[np.ndarray], num_users: int, per_user: int, key_bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, ciphertext bytes, public n bytes) of an encrypted domain upload, or UploadRejected."""
    if len(arrays) != 3:
        raise UploadRejected(f"expected 3 arrays (user ids, ciphertexts, public key), got {len(arrays)}")
    ids, cts, n = (np.asarray(a) for a in arrays)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or np.unique(ids).size != ids.size:
        raise UploadRejected("user ids must be a 1-D array of distinct integers")
    if ids.size and (ids.min() < 0 or ids.max() >= num_users):
        raise UploadRejected(f"user id out of range [0, {num_users})")
    if cts.dtype != np.uint8 or cts.shape != (ids.size * per_user, 2 * key_bits // 8):
        raise UploadRejected(f"ciphertexts have shape {cts.shape}, expected {(ids.size * per_user, 2 * key_bits // 8)} uint8")
    if n.dtype != np.uint8 or n.ndim != 1 or not 0 < n.size <= key_bits // 8 + 1:
        raise UploadRejected("public key must be the modulus as a 1-D uint8 array")
    return ids.astype(np.int64), cts, n


class WassersteinBarycenterStrategy(FedAvg):
    """Aggregates per-user diagonal Gaussians by their W2 barycenter (FPPDM)."""

    def __init__(self, cfg: AppConfig, num_users: int, num_domains: int, recorder: RunRecorder | None = None):
        super().__init__(min_fit_clients=num_domains, min_available_clients=num_domains,
                         min_evaluate_clients=num_domains, accept_failures=True)
        self.cfg, self.num_users, self.num_domains, self.recorder = cfg, num_users, num_domains, recorder
        self.dim = cfg.fppdm.dim
        self.global_ids = np.zeros(0, np.int64)
        self.global_mu = np.zeros((0, self.dim), np.float32)
        self.global_sigma = np.zeros((0, self.dim), np.float32)
        self.domain_users: dict[int, np.ndarray] = {}
        self.encrypted_replies: dict[int, list[np.ndarray]] = {}
        self.per_user_cts = per_user_ciphertexts(FixedPointPacker(key_bits=cfg.fppdm.key_bits), self.dim)
        self.rejections: list[tuple[int, str]] = []
        self.final: dict[str, float] = {}
        self._t0 = time.time()

    def initialize_parameters(self, client_manager):
        """Nothing global exists before the first round."""
        return ndarrays_to_parameters([])

    def _for_domain(self, node_id: int) -> list[np.ndarray]:
        if self.cfg.fppdm.secure:
            return self.encrypted_replies.get(node_id, []) if self.cfg.fppdm.aggregate else []
        users = self.domain_users.get(node_id)
        if users is None or self.global_ids.size == 0 or not self.cfg.fppdm.aggregate:
            return []
        pos = np.searchsorted(self.global_ids, users)
        return [users, self.global_mu[pos], self.global_sigma[pos]]

    def configure_fit(self, server_round, parameters, client_manager):
        """Every domain trains every round, towards the global distributions of its own users."""
        self._t0 = time.time()
        if server_round == 1:  # deployment: domains connect in their own time; wait for all of them
            wait_for_nodes(client_manager, self.num_domains, self.cfg.federation.node_wait_seconds)
        clients = list(client_manager.all().values())
        return [(c, FitIns(ndarrays_to_parameters(self._for_domain(c.node_id)), {"round": server_round})) for c in clients]

    def aggregate_fit(self, server_round, results, failures):
        """Validate uploads, then the per-user barycenter over the domains holding each user."""
        for f in failures:
            self._reject(server_round, f"client failure: {f}")
        uploads, up = [], 0
        for proxy, res in results:
            arrays = parameters_to_ndarrays(res.parameters)
            up += array_bytes(arrays)
            try:
                if self.cfg.fppdm.secure:
                    ids, cts, public_n = validate_encrypted(arrays, self.num_users, self.per_user_cts, self.cfg.fppdm.key_bits)
                    uploads.append((ids, cts, public_n))
                else:
                    ids, mu, sigma = validate_distributions(arrays, self.num_users, self.dim)
                    uploads.append((ids, mu, sigma))
            except UploadRejected as exc:
                self._reject(server_round, f"node {proxy.node_id}: {exc}")
                continue
            self.domain_users[proxy.node_id] = ids
        if uploads and self.cfg.fppdm.secure:
            self._aggregate_encrypted(server_round, uploads)
        elif uploads:  # content order, not arrival order: the float sums are then the same in every run
            ordered = sorted(uploads, key=lambda u: (len(u[0]), u[0].tobytes()))
            self.global_ids, self.global_mu, self.global_sigma = user_barycenters(ordered, self.num_users, self.dim)
        counts = np.bincount(np.concatenate([u[0] for u in uploads]), minlength=self.num_users) if uploads else np.zeros(1)
        self._record({"round": server_round, "phase": "train", "clients": len(results), "accepted": len(uploads),
                      "rejected": len(results) + len(failures) - len(uploads), "overlapping_users": int((counts > 1).sum()),
                      "bytes_up": up / max(len(results), 1),
                      "bytes_down": float(np.mean([array_bytes(self._for_domain(p.node_id)) for p, _ in results])) if results else 0.0,
                      "round_seconds": time.time() - self._t0})
        return ndarrays_to_parameters([]), {}

    def _aggregate_encrypted(self, server_round: int, uploads) -> None:
        """Multiply ciphertexts per user across domains; each domain gets back its users' sums and counts."""
        moduli = {int.from_bytes(n.tobytes(), "big") for _, _, n in uploads}
        if len(moduli) != 1:
            self._reject(server_round, f"domains sent {len(moduli)} different public keys; round not aggregated")
            return
        sums, counts = sum_encrypted([(ids, cts) for ids, cts, _ in uploads], moduli.pop(), self.per_user_cts)
        for node_id, ids in self.domain_users.items():
            cts = [c for u in ids.tolist() for c in sums[u]]
            self.encrypted_replies[node_id] = [ids, ciphertexts_to_array(cts, self.cfg.fppdm.key_bits),
                                               np.array([counts[u] for u in ids.tolist()], np.int64)]

    def configure_evaluate(self, server_round, parameters, client_manager):
        """Every `eval_every` rounds and at the end, all domains evaluate."""
        if server_round % self.cfg.federation.eval_every and server_round != self.cfg.federation.rounds:
            return []
        return [(c, EvaluateIns(ndarrays_to_parameters([]), {"round": server_round})) for c in client_manager.all().values()]

    def aggregate_evaluate(self, server_round, results, failures):
        """Per-domain HR/NDCG and their unweighted mean over domains."""
        per_domain = {str(r.metrics["domain"]): {k: float(v) for k, v in r.metrics.items() if "@" in k} for _, r in results if r.num_examples}
        if not per_domain:
            return None, {}
        keys = sorted({k for m in per_domain.values() for k in m})
        mean = {k: float(np.mean([m[k] for m in per_domain.values()])) for k in keys}
        record = {"round": server_round, **mean, **{f"{d}/{k}": v for d, m in per_domain.items() for k, v in m.items()}}
        self.final = {**mean, **{f"{d}/{k}": v for d, m in per_domain.items() for k, v in m.items()}}
        self._record(record)
        if server_round == self.cfg.federation.rounds and self.recorder is not None:
            self.recorder.finish(self.final, {"rejections": [{"round": r, "reason": w} for r, w in self.rejections]})
            print(f"[fppdm] FINAL {self.final}", flush=True)
        return None, mean

    def evaluate(self, server_round, parameters):
        """The server holds no data to evaluate on."""
        return None

    def _reject(self, server_round: int, reason: str) -> None:
        log.warning("round %d: rejected update: %s", server_round, reason)
        self.rejections.append((server_round, reason))

    def _record(self, record: dict) -> None:
        report_round(self.recorder, "fppdm", record)
