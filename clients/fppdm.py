"""FPPDM client: one domain (cross-silo) holding its whole user-item graph and a Gaussian LightGCN.

Only the domain's users' Gaussians (mu, sigma) leave it (`fedrec_flwr.fppdm.protocol`: the message
layouts); item parameters and interactions stay. Each round it trains `fppdm.training.local_epochs` epochs of the
Wasserstein metric loss plus lambda_P * W2^2(local user, global user) towards the barycenters the server sent back.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.client import NumPyClient

from fedrec_flwr.config import AppConfig
from fedrec_flwr.data import Domain
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer
from fedrec_flwr.fppdm.protocol import (
    frame_ciphertexts,
    frame_gaussians,
    split_encrypted_download,
    split_gaussians,
)
from fedrec_flwr.fppdm.rounds import value_bounds
from fedrec_flwr.fppdm.secure_barycenter import (
    decrypt_barycenters,
    domain_crypto,
    encrypt_users,
    public_n_array,
)


class FPPDMDomainClient(NumPyClient):
    """One domain. `store` keeps the model between rounds (the node's own state).

    The Flower adapter: it hands each core its own `fppdm` sections (the trainer `model`,
    `training`, `coclustering` and the seed; evaluation `evaluation`; encryption `secure`).
    """

    def __init__(self, cfg: AppConfig, domain: Domain, domain_index: int, store, device: torch.device | None = None):
        f = cfg.fppdm
        # the run's value bounds: the model clamps its outputs to them, the server checks them on every upload, and
        # the domain checks every barycenter it is sent against them
        self.max_abs_mu, self.max_sigma = value_bounds(f.server, f.training.margin)
        self.trainer = DomainTrainer(DomainData(domain), domain_index, f.model, f.training, f.coclustering, cfg.seed,
                                     device, (self.max_abs_mu, self.max_sigma))
        self.evaluation = f.evaluation
        self.gaussian = f.model.gaussian
        self.store = store
        self.keys, self.packer = domain_crypto(f.secure) or (None, None)
        saved = store.load()
        if saved is not None:
            self.trainer.load_state(saved)

    def fit(self, parameters, config):
        """Train towards the global user distributions; upload this domain's users' (ids, mu, sigma)."""
        dim = self.trainer.dim
        ids, g_mu, g_sigma = np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros((0, dim), np.float32)
        refused = 0
        if parameters:
            ids, g_mu, g_sigma, refused = self._global_targets(parameters)
        loss = self.trainer.train(int(config["round"]), ids, g_mu, g_sigma)
        self.store.save(self.trainer.state())
        mu, sigma = self.trainer.user_distributions()
        own = self.trainer.data.global_ids.astype(np.int64)
        if self.keys is not None:
            upload = frame_ciphertexts(own, encrypt_users(self.keys, self.packer, mu, sigma), public_n_array(self.keys))
        else:
            upload = frame_gaussians(own, mu, sigma)
        return upload, 1, {"train_loss": loss, "refused_targets": refused}

    def _global_targets(self, parameters) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(ids, mu, sigma, how many were refused) of the server's download, checked before training on it: the
        ids are this domain's own users, and each barycenter (decrypted here under Paillier) is one that honest
        domains' uploads could average to: finite, |mu| and 0 < sigma within `fppdm.rounds.value_bounds` (sigma 0
        for point embeddings). A user whose target fails is trained without one this round; a malformed download
        (wrong arrays, shapes, counts) is refused whole with ValueError naming it."""
        dim = self.trainer.dim
        if self.keys is not None:
            down = split_encrypted_download(parameters)
            ids, counts = np.asarray(down.ids), np.asarray(down.extra)
            if counts.shape != ids.shape or not np.issubdtype(counts.dtype, np.integer) or (counts < 1).any():
                raise ValueError(f"download: domain counts {counts.dtype} {counts.shape}; expected one count >= 1 "
                                 f"per user id ({ids.shape})")
            g_mu, g_sigma = decrypt_barycenters(self.keys, self.packer, down.ciphertexts, counts, dim)
        else:
            ids, g_mu, g_sigma = split_gaussians(parameters)
        if (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)
                or not np.isin(ids, self.trainer.data.global_ids).all()):
            raise ValueError("download: user ids are not a 1-D integer array of this domain's own users")
        if np.shape(g_mu) != (ids.size, dim) or np.shape(g_sigma) != (ids.size, dim):
            raise ValueError(f"download: mu {np.shape(g_mu)} / sigma {np.shape(g_sigma)}, expected {(ids.size, dim)}")
        g_mu, g_sigma = np.asarray(g_mu, np.float64), np.asarray(g_sigma, np.float64)
        ok = np.isfinite(g_mu).all(1) & np.isfinite(g_sigma).all(1) & (np.abs(g_mu) <= self.max_abs_mu).all(1)
        ok &= ((g_sigma > 0) & (g_sigma <= self.max_sigma)).all(1) if self.gaussian else (g_sigma == 0).all(1)
        return (ids[ok].astype(np.int64), g_mu[ok].astype(np.float32), g_sigma[ok].astype(np.float32),
                int((~ok).sum()))

    def evaluate(self, parameters, config):
        """Ranking metrics on this domain's leave-one-out test items."""
        metrics = self.trainer.evaluate(self.evaluation)
        return 0.0, int(metrics["n"]), {**metrics, "domain": self.trainer.data.name}
