"""FPPDM client: one domain (cross-silo) holding its whole user-item graph and a Gaussian LightGCN.

Only the domain's users' Gaussians (mu, sigma) leave it (`fedrec_flwr.fppdm.protocol`: the message
layouts); item parameters and interactions stay. Each round it trains `fppdm.training.local_epochs` epochs of the Wasserstein metric loss plus
lambda_P * W2^2(local user, global user) towards the barycenters the server sent back.
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
        self.trainer = DomainTrainer(DomainData(domain), domain_index, f.model, f.training, f.coclustering, cfg.seed, device)
        self.evaluation = f.evaluation
        self.store = store
        self.keys, self.packer = domain_crypto(f.secure) or (None, None)
        saved = store.load()
        if saved is not None:
            self.trainer.load_state(saved)

    def fit(self, parameters, config):
        """Train towards the global user distributions; upload this domain's users' (ids, mu, sigma)."""
        dim = self.trainer.dim
        ids, g_mu, g_sigma = np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros((0, dim), np.float32)
        if parameters and self.keys is not None:  # encrypted sums: decrypt here, divide by the domain counts
            down = split_encrypted_download(parameters)
            ids = down.ids.astype(np.int64)
            g_mu, g_sigma = decrypt_barycenters(self.keys, self.packer, down.ciphertexts, down.extra, dim)
        elif parameters:
            down = split_gaussians(parameters)
            ids, g_mu, g_sigma = down.ids.astype(np.int64), down.mu.astype(np.float32), down.sigma.astype(np.float32)
        loss = self.trainer.train(int(config["round"]), ids, g_mu, g_sigma)
        self.store.save(self.trainer.state())
        mu, sigma = self.trainer.user_distributions()
        own = self.trainer.data.global_ids.astype(np.int64)
        if self.keys is not None:
            upload = frame_ciphertexts(own, encrypt_users(self.keys, self.packer, mu, sigma), public_n_array(self.keys))
        else:
            upload = frame_gaussians(own, mu, sigma)
        return upload, 1, {"train_loss": loss}

    def evaluate(self, parameters, config):
        """Ranking metrics on this domain's leave-one-out test items."""
        metrics = self.trainer.evaluate(self.evaluation)
        return 0.0, int(metrics["n"]), {**metrics, "domain": self.trainer.data.name}
