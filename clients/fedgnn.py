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
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EVALUATE_SUM,
    PHASE_EXPAND_FETCH,
    PHASE_EXPAND_SUBMIT,
    PHASE_POPULARITY,
    PHASE_REGISTER,
    RoundConfig,
    frame_registration,
    frame_users,
    published_popularity,
    split_download,
)
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, UserStore
from fedrec_flwr.models.rating_gnn import build_model
from fedrec_flwr.privacy.device_secret import DeviceSecret
from fedrec_flwr.privacy_modes import privacy_mode


class FedGNNClient(NumPyClient):
    """The users hosted on one node; `load_user(u)` gives a user's data, `store` their saved states."""

    def __init__(self, cfg: AppConfig, meta: PartitionMeta, user_ids: list[int], load_user: Callable[[int], UserData],
                 store: UserStore, device: torch.device | None = None, *, secret: DeviceSecret,
                 terms: DeviceTerms | None = None, neighbour_service: str | None = None, neighbour_ca: str = ""):
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
        self.mode = privacy_mode(cfg.privacy.mode).device(cfg.privacy)  # what the users protect and upload, and how
        self.device = device or torch.device("cpu")
        # one copy, shared by the hosted users in turn
        self.model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)

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
            if not self.mode.reports_popularity():
                raise ValueError("a popularity report is sent only for the popularity-matched sampler of the LDP mode")
            reports = [self._user(u).report_popularity() for u in self.user_ids]
            return frame_users(self.user_ids, [[r] for r in reports], 1), len(reports), {"phase": rc.phase}
        if rc.phase == PHASE_REGISTER:
            popularity = published_popularity(parameters, self.meta.num_items)
            users = [self._user(u) for u in self.user_ids]
            sets = [u.register(popularity) for u in users]
            return frame_registration(self.user_ids, sets,
                                      [u.registered_test_count for u in users]), len(users), {"phase": rc.phase}
        if rc.phase in (PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH):
            if rc.expansion is None:
                raise ValueError(f"phase {rc.phase} without a neighbour-service link in the server config")
            counts = [self._user(u).expand(rc.expansion, rc.retries, rc.phase == PHASE_EXPAND_SUBMIT,
                                           rc.phase == PHASE_EXPAND_FETCH, rc.round) for u in self.user_ids]
            return [], len(counts), {"phase": rc.phase, "neighbours": int(sum(counts)), "users": len(counts)}
        if rc.phase == PHASE_EVALUATE_SUM:
            return self.mode.evaluation_sum_reply(self._user, self.user_ids, parameters, rc, self.num_weights,
                                                  self.terms)
        return self.mode.train_reply(self._user, self.user_ids, parameters, rc, self.num_weights,
                                     self.cfg.simulation.user_batch, self.terms)

    def _check_link(self, rc: RoundConfig) -> None:
        """ValueError unless the round's neighbour-service link may be used: none under user-level DP (the service
        would get embeddings and item tokens outside SecAgg+), and on a deployed device only the service its own
        node config names. A server that pointed devices at an address of its own would otherwise receive their
        item tokens, under the HMAC key it also sends, and read the items."""
        if rc.expansion is None and not rc.refresh_neighbours:
            return
        if not self.mode.expands_graph:
            raise ValueError("this privacy mode does no graph expansion; the round's config carries a "
                             "neighbour-service link")
        if self.neighbour_service is not None and (rc.expansion is None
                                                   or rc.expansion.address != self.neighbour_service):
            raise ValueError("the server points this device at another neighbour service than the one its node config "
                             "names (neighbour-service)")
        if self.neighbour_service is not None and not self.device_cfg.ca_file:
            raise ValueError("this device contacts its neighbour service only over TLS, with the CA file its node "
                             "config names (neighbour-ca-file)")

    def evaluate(self, parameters, config):
        """Squared and absolute error sums over the requested users' own test ratings. Never in a privacy mode whose
        error sums leave the device only through a noisy secure sum (`DeviceMechanism.evaluation_sum_reply`)."""
        if not self.mode.plain_evaluation:
            raise ValueError("this privacy mode sends no plain evaluation (its error sums go through SecAgg+ only)")
        self.store.begin_round(RoundConfig.from_flower(config))
        weights, users, rows = split_download(parameters, self.num_weights)
        sse = sae = 0.0
        n = 0
        for u, r in zip(users, rows):
            s, a, k = self._user(int(u)).evaluate(weights, r)
            sse, sae, n = sse + s, sae + a, n + k
        return (float(np.sqrt(sse / n)) if n else 0.0), n, {"sse": sse, "sae": sae, "n": n}
