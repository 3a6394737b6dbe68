"""FedGNN's Flower client: a NumPyClient hosting one user (deployment) or several (simulation).

A deployed SuperNode is one user's device. A simulation can multiplex `users_per_node`
users onto each virtual SuperNode so that Flower's per-node cost does not grow with the
number of users; each hosted user keeps its own data, state and randomness, and uploads
its own separately protected gradients (see `fedrec_flwr.fedgnn.protocol` for the framing).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch
from flwr.client import NumPyClient

from clients.privacy_guard import DeviceTerms
from fedrec_flwr.config import AppConfig
from fedrec_flwr.data import UserData
from fedrec_flwr.data.partition import PartitionMeta
from fedrec_flwr.fedgnn.accounting import epsilon_per_coordinate
from fedrec_flwr.fedgnn.local_step import train_users
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EVALUATE_SUM,
    PHASE_EXPAND_FETCH,
    PHASE_EXPAND_SUBMIT,
    PHASE_POPULARITY,
    PHASE_REGISTER,
    PHASE_TRAIN,
    RoundConfig,
    frame_registration,
    frame_train_upload,
    frame_users,
    published_popularity,
    split_download,
    split_table_download,
)
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, UserStore
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.privacy.device_secret import DeviceSecret


class FedGNNClient(NumPyClient):
    """The users hosted on one node; `load_user(u)` gives a user's data, `store` their saved states."""

    def __init__(self, cfg: AppConfig, meta: PartitionMeta, user_ids: list[int], load_user: Callable[[int], UserData],
                 store: UserStore, device: torch.device | None = None, *, secret: DeviceSecret, terms: DeviceTerms | None = None,
                 neighbour_service: str | None = None, neighbour_ca: str = ""):
        """`secret`: the device's own (`client_app.device_secret`), never the run config's; `terms`: what the device
        computed for itself about a user-DP run (q and its noise share; required in that mode); `neighbour_service`:
        the only neighbour-service address a deployed device contacts (its node config; "" none), or None in a
        simulation, where the experimenter runs server and service alike; `neighbour_ca`: a deployed device's CA
        file for that service (its node config), never the run config's, so the server cannot turn TLS off."""
        self.neighbour_service = neighbour_service
        self.cfg, self.meta, self.user_ids, self.load_user, self.store = cfg, meta, list(user_ids), load_user, store
        self._hosted = set(self.user_ids)
        self.device_cfg = DeviceSections.from_config(cfg, secret)  # the sections each hosted user reads
        if neighbour_service is not None:  # deployed: TLS to the service by its own CA file, or no expansion
            self.device_cfg = dataclasses.replace(self.device_cfg, ca_file=neighbour_ca)
        self.terms = terms
        self.device = device or torch.device("cpu")
        self.model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)  # one copy, shared by the hosted users in turn

    def _user(self, u: int) -> FedGNNUser:
        if u not in self._hosted:
            raise ValueError(f"user {u} is not hosted on this node (hosts {self.user_ids[:5]}...)")
        return FedGNNUser(self.device_cfg, self.meta, self.load_user(u), self.store, self.device, self.model)

    @property
    def num_weights(self) -> int:
        """How many model arrays head a download."""
        return len(list(self.model.parameters()))

    def fit(self, parameters, config):
        """Register, expand the graph, or train the requested users (by the round config's phase)."""
        rc = RoundConfig.from_flower(config)
        self._check_link(rc)
        self.store.begin_round(rc)
        if rc.phase == PHASE_POPULARITY:
            if self.cfg.privacy.pseudo_sampler != "popularity" or self.cfg.privacy.mode == "user_dp":
                raise ValueError("a popularity report is sent only for the popularity-matched sampler of the LDP mode")
            reports = [self._user(u).report_popularity() for u in self.user_ids]
            return frame_users(self.user_ids, [[r] for r in reports], 1), len(reports), {"phase": rc.phase}
        if rc.phase == PHASE_REGISTER:
            popularity = published_popularity(parameters, self.meta.num_items)
            users = [self._user(u) for u in self.user_ids]
            sets = [u.register(popularity) for u in users]
            return frame_registration(self.user_ids, sets, [u.registered_test_count for u in users]), len(users), {"phase": rc.phase}
        if rc.phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            if rc.expansion is None:
                raise ValueError(f"phase {rc.phase} without a neighbour-service link in the server config")
            counts = [self._user(u).expand(rc.expansion, rc.retries, rc.phase == PHASE_EXPAND_SUBMIT,
                                           rc.phase == PHASE_EXPAND_FETCH, rc.round) for u in self.user_ids]
            return [], len(counts), {"phase": rc.phase, "neighbours": int(sum(counts)), "users": len(counts)}
        if rc.phase == PHASE_EVALUATE_SUM:
            return self._fit_evaluate_sum(parameters, rc)
        if self.cfg.privacy.mode == "user_dp":
            return self._fit_user_dp(parameters, rc)
        weights, users, rows = split_download(parameters, self.num_weights)
        parts = train_users([self._user(int(u)) for u in users], weights, rows, rc.round, rc,
                            self.cfg.simulation.user_batch)
        upload = frame_train_upload(users, parts)
        p = self.cfg.privacy
        eps = epsilon_per_coordinate(p.clip_delta, p.noise_lambda) if p.ldp else float("inf")
        return upload, len(users), {"phase": PHASE_TRAIN, "epsilon_per_coordinate": eps}

    def _check_link(self, rc: RoundConfig) -> None:
        """ValueError unless the round's neighbour-service link may be used: none under user-level DP (the service
        would get embeddings and item tokens outside SecAgg+), and on a deployed device only the service its own
        node config names. A server that pointed devices at an address of its own would otherwise receive their
        item tokens, under the HMAC key it also sends, and read the items."""
        if rc.expansion is None and not rc.refresh_neighbours:
            return
        if self.cfg.privacy.mode == "user_dp":
            raise ValueError("a user-DP device does no graph expansion; the round's config carries a neighbour-service link")
        if self.neighbour_service is not None and (rc.expansion is None or rc.expansion.address != self.neighbour_service):
            raise ValueError("the server points this device at another neighbour service than the one its node config "
                             "names (neighbour-service)")
        if self.neighbour_service is not None and not self.device_cfg.ca_file:
            raise ValueError("this device contacts its neighbour service only over TLS, with the CA file its node "
                             "config names (neighbour-ca-file)")

    def _fit_user_dp(self, parameters, rc: RoundConfig):
        """User-level DP: every hosted user is asked; those that sample themselves contribute their clipped update,
        and the node's one vector (with the noise share of all it hosts) goes through SecAgg+ (`fedgnn.user_dp`).
        num_examples is 1 so that SecAgg+'s weighted mean over nodes times their number is the plain sum."""
        from fedrec_flwr.fedgnn.user_dp import node_update

        if self.terms is None:
            raise ValueError("a user-DP round on a node without its own privacy terms (clients.privacy_guard.DeviceTerms)")
        weights, table, _ = split_table_download(parameters, self.num_weights)  # every hosted user is asked
        vector = node_update([self._user(u) for u in self.user_ids], weights, table, rc.round, rc,
                             self.cfg.simulation.user_batch, self.terms.q, self.terms.share_std,
                             cover=self.terms.policy.hides_timing)
        return vector, 1, {"phase": PHASE_TRAIN, "users": len(self.user_ids)}

    def _fit_evaluate_sum(self, parameters, rc: RoundConfig):
        """User-level DP's evaluation: every hosted user's clipped, normalised error sums on its own test ratings, summed
        with the node's noise share, go through SecAgg+ like a training vector (`fedgnn.user_dp.node_evaluation`)."""
        from fedrec_flwr.fedgnn.user_dp import node_evaluation

        if self.cfg.privacy.mode != "user_dp" or self.terms is None:
            raise ValueError("an evaluate-sum round outside a user-DP run (or without the device's own terms)")
        weights, table, _ = split_table_download(parameters, self.num_weights)
        vector = node_evaluation([self._user(u) for u in self.user_ids], weights, table, rc.round,
                                 self.cfg.privacy.eval_max_ratings, self.terms.eval_share_std)
        return vector, 1, {"phase": PHASE_EVALUATE_SUM, "users": len(self.user_ids)}

    def evaluate(self, parameters, config):
        """Squared and absolute error sums over the requested users' own test ratings. Never under user-level DP:
        there a user's error sums leave the device only through the noisy secure sum (`_fit_evaluate_sum`)."""
        if self.cfg.privacy.mode == "user_dp":
            raise ValueError("a user-DP device sends no plain evaluation (its error sums go through SecAgg+ only)")
        self.store.begin_round(RoundConfig.from_flower(config))
        weights, users, rows = split_download(parameters, self.num_weights)
        sse = sae = 0.0
        n = 0
        for u, r in zip(users, rows):
            s, a, k = self._user(int(u)).evaluate(weights, r)
            sse, sae, n = sse + s, sae + a, n + k
        return (float(np.sqrt(sse / n)) if n else 0.0), n, {"sse": sse, "sae": sae, "n": n}
