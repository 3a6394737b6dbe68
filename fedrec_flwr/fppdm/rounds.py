"""One FPPDM run's rounds, independent of how messages travel.

The Flower strategy (`strategies.fppdm`) is a transport over this core, so every round step has
exactly one implementation:

1. download: each domain gets the global Gaussians of its own users (plaintext), or the summed
   ciphertexts and domain counts of its users (Paillier, `fppdm.secure.enabled`);
2. train: validate each domain's upload (user ids distinct and in range, shapes, dtypes; in
   plaintext also mu and sigma finite, |mu| and 0 < sigma within `value_bounds` (the model's scale, or
   `fppdm.server.max_abs_mu` / `max_sigma`), or sigma = 0 for point embeddings), then, if at least
   `federation.min_clients` uploads were accepted, the per-user closed-form W2 barycenter over the domains holding each
   user (in plaintext, or as a product of ciphertexts the domains decrypt); fewer leave the global users unchanged;
3. evaluate: every `eval_every` rounds and at the end each domain reports HR@K / NDCG@K on its own
   leave-one-out test users; the core keeps them per domain and their unweighted mean.

Rejected messages are logged, counted and never averaged in. Under Paillier the server sees no
value, so only ids, shapes and the public key can be checked here.

Message layouts: `fedrec_flwr.fppdm.protocol`. The core reads only its sections: `fppdm.model` (dim, gaussian),
`fppdm.server`, `fppdm.secure` and `federation`; `FPPDMRounds.from_config` picks them (and the node list) out of a run's
config.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fedrec_flwr.config import FederationConfig, FPPDMModelConfig, FPPDMServerConfig, SecureAggregationConfig
from fedrec_flwr.fppdm.barycenter import UserGaussians, user_barycenters
from fedrec_flwr.fppdm.bounds import MAX_ABS_MU, MAX_SIGMA, value_bounds
from fedrec_flwr.fppdm.protocol import frame_ciphertexts, frame_gaussians, split_encrypted_upload, split_gaussians
from fedrec_flwr.fppdm.secure_barycenter import per_user_ciphertexts, sum_encrypted
from fedrec_flwr.messages import NodeReply, UploadRejected, array_bytes
from fedrec_flwr.node_list import load_node_list
from fedrec_flwr.privacy.paillier_pack import FixedPointPacker, ciphertexts_to_array
from fedrec_flwr.reporting.results import RunRecorder, failure_reason, report_failure, report_final, report_round

if TYPE_CHECKING:
    from fedrec_flwr.config import AppConfig

log = logging.getLogger("fedrec_flwr.fppdm")

__all__ = ["MAX_ABS_MU", "MAX_SIGMA", "EncryptedUpload", "FPPDMRounds", "NodeReply", "UserGaussians",
           "validate_distributions", "validate_encrypted", "value_bounds"]


class EncryptedUpload(NamedTuple):
    """A domain's Paillier upload: global user ids [n], ciphertext bytes [n * per_user, width], public modulus bytes."""

    ids: np.ndarray
    ciphertexts: np.ndarray
    public_n: np.ndarray


def _check_ids(ids: np.ndarray, num_users: int) -> None:
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UploadRejected("user ids must be a 1-D integer array")
    if ids.size and (ids.min() < 0 or ids.max() >= num_users):
        raise UploadRejected(f"user id out of range [0, {num_users})")
    if np.unique(ids).size != ids.size:
        raise UploadRejected("duplicate user ids")


def validate_distributions(arrays: list[np.ndarray], num_users: int, dim: int, *, gaussian: bool = True,
                           max_abs_mu: float = MAX_ABS_MU, max_sigma: float = MAX_SIGMA) -> UserGaussians:
    """A plaintext domain upload [user ids, mu, sigma] as `UserGaussians`, or UploadRejected naming what is wrong.

    mu and sigma must be finite floats of shape [users, dim] with |mu| <= max_abs_mu; sigma is a
    standard deviation, 0 < sigma <= max_sigma, or exactly 0 for point embeddings (gaussian=False).
    """
    ids, mu, sigma = split_gaussians(arrays)
    _check_ids(ids, num_users)
    for name, a in (("mu", mu), ("sigma", sigma)):
        if a.shape != (ids.size, dim):
            raise UploadRejected(f"{name} has shape {a.shape}, expected {(ids.size, dim)}")
        if not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
            raise UploadRejected(f"{name} has NaN/Inf or a non-float dtype")
    if mu.size and np.abs(mu).max() > max_abs_mu:
        raise UploadRejected(f"|mu| = {np.abs(mu).max():.3g} exceeds the bound {max_abs_mu:g}")
    if gaussian and (sigma <= 0).any():
        raise UploadRejected(f"sigma = {sigma.min():.3g}; a standard deviation must be positive")
    if not gaussian and (sigma != 0).any():
        raise UploadRejected("sigma must be 0: the domains train point embeddings (fppdm.model.gaussian = false)")
    if sigma.size and sigma.max() > max_sigma:
        raise UploadRejected(f"sigma = {sigma.max():.3g} exceeds the bound {max_sigma:g}")
    return UserGaussians(ids.astype(np.int64), mu.astype(np.float32), sigma.astype(np.float32))


def validate_encrypted(arrays: list[np.ndarray], num_users: int, per_user: int, key_bits: int) -> EncryptedUpload:
    """An encrypted domain upload [user ids, ciphertexts, public n] as `EncryptedUpload`, or UploadRejected."""
    ids, cts, n = split_encrypted_upload(arrays)
    _check_ids(ids, num_users)
    if cts.dtype != np.uint8 or cts.shape != (ids.size * per_user, 2 * key_bits // 8):
        raise UploadRejected(f"ciphertexts have shape {cts.shape}, expected "
                             f"{(ids.size * per_user, 2 * key_bits // 8)} uint8")
    if n.dtype != np.uint8 or n.ndim != 1 or not 0 < n.size <= key_bits // 8 + 1:
        raise UploadRejected("public key must be the modulus as a 1-D uint8 array")
    return EncryptedUpload(ids.astype(np.int64), cts, n)


def _empty_users(dim: int) -> UserGaussians:
    return UserGaussians(np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros((0, dim), np.float32))


class FPPDMRounds:
    """Downloads, training rounds (validation and barycenter) and evaluation of one FPPDM run."""

    def __init__(self, num_users: int, model: FPPDMModelConfig, server: FPPDMServerConfig,
                 secure: SecureAggregationConfig, federation: FederationConfig,
                 recorder: RunRecorder | None = None, listed: dict[int, int] | None = None,
                 domain_names: list[str] | None = None, topk: list[int] | tuple[int, ...] = (5, 10),
                 margin: float = 1.0):
        self.num_users, self.recorder = num_users, recorder
        self.model, self.server, self.secure, self.federation = model, server, secure, federation
        # deployment: node -> its domain index, from the operator's node list; unlisted nodes contribute
        # nothing (None: any node, simulation)
        self.listed = listed
        self.domain_names = domain_names  # the dataset's domain names, in index order (None: not known)
        self.expected_metrics = {f"{m}@{k}" for k in topk for m in ("hr", "ndcg")}  # what an evaluation reply carries
        self.domain_of_node: dict[int, str] = {}  # the domain each node evaluated as (bound at its first reply)
        self.pinned_modulus: int | None = None  # Paillier: the one public modulus every domain must use
        self.dim = model.dim
        self.max_abs_mu, self.max_sigma = value_bounds(server, margin)
        self.packer = FixedPointPacker(key_bits=secure.key_bits)
        self.per_user_cts = per_user_ciphertexts(self.packer, self.dim)
        self.global_users = _empty_users(self.dim)  # plaintext barycenters, ids sorted
        self.domain_users: dict[int, np.ndarray] = {}  # node -> the user ids of its last accepted upload
        self.encrypted_replies: dict[int, list[np.ndarray]] = {}  # node -> [ids, summed ciphertexts, counts]
        self.rejections: list[tuple[int, str]] = []
        self.final: dict[str, float] = {}
        self.train_rounds = self.rounds_not_applied = 0  # rounds trained, and those with < min_clients uploads

    @classmethod
    def from_config(cls, cfg: AppConfig, num_users: int, recorder: RunRecorder | None = None,
                    num_domains: int = 0, domain_names: list[str] | None = None) -> FPPDMRounds:
        """The round core of one run: its FPPDM sections, its schedule, the dataset's domain names, and the
        operator's node list {node id: [domain index]} when `deployment.node_list` names one."""
        listed = None
        if cfg.deployment.node_list:
            listed = {node: min(ids) for node, ids in load_node_list(cfg.deployment.node_list, num_domains).items()
                      if ids}
        f = cfg.fppdm
        return cls(num_users, f.model, f.server, f.secure, cfg.federation, recorder, listed, domain_names,
                   f.evaluation.topk, f.training.margin)

    # -- bookkeeping -----------------------------------------------------------------
    def reject(self, server_round: int, reason: str) -> None:
        """Log and count one rejected message."""
        log.warning("round %d: rejected update: %s", server_round, reason)
        self.rejections.append((server_round, reason))

    def record(self, record: dict, complete: bool = True) -> None:
        """Add one round's record to the run's results and its console line (printed once the round is
        complete: a round that evaluates prints one line, with its evaluation)."""
        report_round(self.recorder, "fppdm", record, complete)

    # -- downloads -------------------------------------------------------------------
    def download(self, node_id: int) -> list[np.ndarray]:
        """What a domain trains towards: [its user ids, their global mu, sigma] ([ids, ciphertexts, counts]
        under Paillier); empty before the first applied round, for an unknown node, or with
        fppdm.server.aggregate off."""
        if not self.server.aggregate:
            return []
        if self.secure.enabled:
            return self.encrypted_replies.get(node_id, [])
        users = self.domain_users.get(node_id)
        glob = self.global_users
        if users is None or glob.ids.size == 0:
            return []
        pos = np.searchsorted(glob.ids, users)
        known = (pos < glob.ids.size) & (glob.ids[np.minimum(pos, glob.ids.size - 1)] == users)
        if not known.all():  # users of a domain whose latest upload was refused: only those with a barycenter
            users, pos = users[known], pos[known]
        return frame_gaussians(users, glob.mu[pos], glob.sigma[pos])

    # -- training --------------------------------------------------------------------
    def validate_reply(self, server_round: int, reply: NodeReply) -> UserGaussians | EncryptedUpload | None:
        """The domain's upload, checked; None (logged and counted) when it is refused."""
        try:
            if self.listed is not None and reply.node_id not in self.listed:
                raise UploadRejected("this SuperNode is not a domain of deployment.node_list")
            if self.secure.enabled:
                upload = validate_encrypted(reply.arrays, self.num_users, self.per_user_cts, self.secure.key_bits)
            else:
                upload = validate_distributions(reply.arrays, self.num_users, self.dim, gaussian=self.model.gaussian,
                                                max_abs_mu=self.max_abs_mu, max_sigma=self.max_sigma)
            if upload.ids.size == 0:  # counts toward nothing: min_clients means domains that sent users
                raise UploadRejected("an upload without users")
            return upload
        except UploadRejected as exc:
            self.reject(server_round, f"node {reply.node_id}: {exc}")
            return None

    def train(self, server_round: int, replies: list[NodeReply], failures: list[str], started: float) -> dict:
        """Validate every upload; with at least min_clients accepted, the per-user barycenter; record the round."""
        for why in failures:
            self.reject(server_round, f"client failure: {why}")
        uploads: list[UserGaussians | EncryptedUpload] = []
        up = 0
        for reply in replies:
            up += array_bytes(reply.arrays)
            upload = self.validate_reply(server_round, reply)
            if upload is None:
                continue
            uploads.append(upload)
            self.domain_users[reply.node_id] = upload.ids
        if self.train_rounds == 0 and not uploads and (failures or replies):  # nothing can start: say why now
            reasons = [why for r, why in self.rejections if r == server_round][:3]
            raise RuntimeError(f"round {server_round}: no domain's upload was accepted, so the run cannot start: "
                               + "; ".join(reasons))
        applied = len(uploads) >= self.federation.min_clients
        self.train_rounds += 1
        if not applied:
            log.warning("round %d: %d accepted uploads < min_clients=%d; global users unchanged",
                        server_round, len(uploads), self.federation.min_clients)
        elif self.secure.enabled:
            applied = self.aggregate_encrypted(server_round, uploads)
        else:  # content order, not arrival order: the float sums are then the same in every run
            ordered = sorted(uploads, key=lambda u: (len(u.ids), u.ids.tobytes()))
            self.global_users = user_barycenters(ordered, self.num_users, self.dim)
        self.rounds_not_applied += not applied
        counts = np.bincount(np.concatenate([u.ids for u in uploads]),
                             minlength=self.num_users) if uploads else np.zeros(1)
        record = {"round": server_round, "phase": "train", "clients": len(replies), "accepted": len(uploads),
                  "rejected": len(replies) + len(failures) - len(uploads), "applied": applied,
                  "overlapping_users": int((counts > 1).sum()), "bytes_up": up / max(len(replies), 1),
                  "bytes_down": float(np.mean([array_bytes(self.download(r.node_id)) for r in replies])) if replies
                                else 0.0,
                  "round_seconds": time.time() - started}
        self.record(record, complete=not self.is_eval_round(server_round))
        return record

    def aggregate_encrypted(self, server_round: int, uploads: list[EncryptedUpload]) -> bool:
        """Multiply ciphertexts per user across domains; each domain gets back its users' sums and counts.
        False (the round is not aggregated) when the domains used different keys or too many domains
        would overflow the fixed-point slots."""
        moduli = [int.from_bytes(u.public_n.tobytes(), "big") for u in uploads]
        if self.pinned_modulus is None:
            if len(set(moduli)) != 1:  # the domains hold different key files: nothing they send can be summed
                raise RuntimeError(f"the domains sent {len(set(moduli))} different Paillier public keys in round "
                                   f"{server_round}: every domain must load the same fppdm.secure.key_file")
            self.pinned_modulus = moduli[0]
        kept = [u for u, n in zip(uploads, moduli) if n == self.pinned_modulus]
        for _ in range(len(uploads) - len(kept)):
            self.reject(server_round, "an upload under another Paillier public key than the run's")
        if len(kept) < self.federation.min_clients:
            return False
        uploads = kept
        if len(uploads) > self.packer.max_terms:
            self.reject(server_round, f"{len(uploads)} domain uploads exceed the {self.packer.max_terms} that "
                                      "fixed-point slots can sum; round not aggregated")
            return False
        sums, counts = sum_encrypted([(u.ids, u.ciphertexts) for u in uploads], self.pinned_modulus, self.per_user_cts)
        for node_id, ids in self.domain_users.items():
            if not all(u in sums for u in ids.tolist()):  # a domain whose latest upload was refused
                ids = np.asarray([u for u in ids.tolist() if u in sums], np.int64)
            cts = [c for u in ids.tolist() for c in sums[u]]
            self.encrypted_replies[node_id] = frame_ciphertexts(ids, ciphertexts_to_array(cts, self.secure.key_bits),
                                                                np.array([counts[u] for u in ids.tolist()], np.int64))
        return True

    # -- evaluation ------------------------------------------------------------------
    def is_eval_round(self, server_round: int) -> bool:
        """Every `eval_every` rounds and the last round."""
        fed = self.federation
        return server_round % fed.eval_every == 0 or server_round == fed.rounds

    def check_eval_reply(self, reply: NodeReply) -> tuple[str, dict[str, float]] | None:
        """(domain name, its HR@K / NDCG@K and "ranked": how many test users it ranked) of one evaluation
        reply; None when the domain has no test user; UploadRejected when the reply is not one an honest
        domain could send: a metric missing or extra, a value outside [0, 1], a domain name the dataset does
        not have, or not the node's own (the node list's in deployment; the name it first evaluated as)."""
        m = reply.metrics
        n = m.get("n", 0)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise UploadRejected(f"evaluation n = {n!r}; expected a non-negative integer")
        if n == 0:
            return None
        name = m.get("domain")
        if not isinstance(name, str):
            raise UploadRejected("evaluation reply needs the domain's name")
        if self.domain_names is not None and name not in self.domain_names:
            raise UploadRejected(f"evaluation names domain {name!r}; the dataset's domains are {self.domain_names}")
        if self.listed is not None and self.domain_names is not None:
            own = self.domain_names[self.listed[reply.node_id]] if reply.node_id in self.listed else None
            if name != own:
                raise UploadRejected(f"evaluation names domain {name!r}; the node list assigns this node {own!r}")
        bound = self.domain_of_node.get(reply.node_id)
        if bound is not None and bound != name:
            raise UploadRejected(f"evaluation names domain {name!r}; this node evaluated as {bound!r} before")
        if any(d == name for node, d in self.domain_of_node.items() if node != reply.node_id):
            raise UploadRejected(f"domain {name!r} is already evaluated by another node")
        got = {k for k in m if "@" in k}
        if got != self.expected_metrics:
            missing, extra = sorted(self.expected_metrics - got), sorted(got - self.expected_metrics)
            raise UploadRejected(f"evaluation metrics missing {missing} / unexpected {extra}; expected exactly "
                                 f"{sorted(self.expected_metrics)}")
        scores = {"ranked": int(n)}
        for k in sorted(got):
            try:
                x = float(m[k])
            except (TypeError, ValueError):
                raise UploadRejected(f"evaluation {k} = {m[k]!r}; expected a number") from None
            if not (math.isfinite(x) and 0.0 <= x <= 1.0):
                raise UploadRejected(f"evaluation {k} = {x}; expected a finite value in [0, 1]")
            scores[k] = x
        return name, scores

    def evaluate(self, server_round: int, replies: list[NodeReply]) -> dict[str, float] | None:
        """Mean over domains of each metric (None when no domain reported); per-domain values are recorded.

        A node is bound to the domain it first evaluates as; two nodes naming the same domain in one round
        are both refused (no first come, first served)."""
        claims: list[tuple[int, str, dict[str, float]]] = []
        for reply in replies:
            try:
                checked = self.check_eval_reply(reply)
            except UploadRejected as exc:
                self.reject(server_round, f"node {reply.node_id}: {exc}")
                continue
            if checked is not None:
                claims.append((reply.node_id, *checked))
        per_domain: dict[str, dict[str, float]] = {}
        for node, name, scores in claims:
            if sum(1 for _, other, _ in claims if other == name) > 1:
                self.reject(server_round, f"node {node}: domain {name!r} is evaluated by more than one node")
                continue
            self.domain_of_node[node] = name
            per_domain[name] = scores
        if not per_domain:
            return None
        keys = sorted({k for m in per_domain.values() for k in m} - {"ranked"})
        mean = {k: float(np.mean([m[k] for m in per_domain.values()])) for k in keys}
        ranked = {"ranked_users": sum(m["ranked"] for m in per_domain.values())}  # test users ranked, all domains
        self.final = {**mean, **ranked, **{f"{d}/{k}": v for d, m in per_domain.items() for k, v in m.items()}}
        self.record({"round": server_round, **self.final})
        return mean

    def failure(self) -> str | None:
        """Why the run must not report a result, or None: no round was applied (every one had fewer than
        min_clients accepted uploads), or no domain's evaluation was accepted."""
        return failure_reason(self.train_rounds, self.rounds_not_applied, self.federation.min_clients, self.rejections,
                              bool(self.final), "no domain's evaluation was accepted")

    def finish(self) -> None:
        """Write the final metrics and the rejections, and print them; a run that `failure` names is marked
        failed instead, with no result."""
        if self.recorder is None or self.recorder.finished:
            return
        why = self.failure()
        if why is not None:
            report_failure("fppdm", why, self.recorder.fail(why))
            return
        self.recorder.finish(self.final, {"rejections": [{"round": r, "reason": w} for r, w in self.rejections],
                                          "rounds_not_applied": self.rounds_not_applied})
        report_final("fppdm", self.final, self.recorder.output_dir / "results.json")
