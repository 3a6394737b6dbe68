"""The paper's privacy mode (`privacy.mode = ldp`): each user hides its items among pseudo items (its anonymity
set) and clips and Laplace-noises every coordinate of its upload (with `privacy.ldp`); the server checks and merges
each user's upload on its own, and counts every user's uploads against its per-coordinate budget
(`accounting.LDPAccountant`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fedrec_flwr.config import ConfigError
from fedrec_flwr.fedgnn.accounting import LDPAccountant, epsilon_per_coordinate
from fedrec_flwr.fedgnn.checkpoint import CheckpointError
from fedrec_flwr.fedgnn.local_step import train_users
from fedrec_flwr.fedgnn.modes.base import DeviceMechanism, ServerMechanism
from fedrec_flwr.fedgnn.protocol import PHASE_TRAIN, frame_download, frame_train_upload, split_download
from fedrec_flwr.fedgnn.server import sample_users

if TYPE_CHECKING:
    from fedrec_flwr.config import AppConfig
    from fedrec_flwr.fedgnn.protocol import RoundConfig


def check_config(cfg: AppConfig) -> None:
    """Per-coordinate LDP needs Laplace noise of a positive scale, and real rows the pseudo rows can imitate: the
    population loss on the items' own terms (model.population_item_weight) adds a direction to the real rows that
    the pseudo rows, a Gaussian fitted to them, do not reproduce (the audit's real-versus-pseudo AUC rose from 0.53
    to 0.66 with it). A device loads the run config it is sent through this same check."""
    if cfg.privacy.ldp and cfg.privacy.noise_lambda <= 0:
        raise ConfigError("config key 'privacy.noise_lambda' must be > 0 when privacy.ldp is true")
    if cfg.model.population_item_weight > 0:
        raise ConfigError(f"config key 'model.population_item_weight' = {cfg.model.population_item_weight} is "
                          "user-level DP only (privacy.mode = user_dp): under the paper's LDP the pseudo rows would "
                          "not imitate what it adds to the real rows, and the server could tell them apart")


class Device(DeviceMechanism):
    """A user registers its anonymity set, trains on the rows of it, and uploads clipped, noised gradients."""

    name = "ldp"
    whole_table = False  # an anonymity set of pseudo items, and only its rows
    expands_graph = True
    plain_evaluation = True  # error sums on the device's own test ratings, bounded by the server
    needs_terms = False

    def reports_popularity(self) -> bool:
        """The popularity-matched sampler needs every user's LDP report of its items first."""
        return self.privacy.pseudo_sampler == "popularity"

    def admit(self, policy: Any) -> None:
        """The device takes part in LDP runs only when its operator opted in, and at its own least protection."""
        policy.admit_mode(self.name)
        policy.admit_ldp(self.privacy)

    def train_reply(self, user_of, hosted, parameters, rc: RoundConfig, num_weights, user_batch, terms):
        """Each user the server sampled trains on its rows and protects its own upload (`local_step.train_users`)."""
        weights, users, rows = split_download(parameters, num_weights)
        parts = train_users([user_of(int(u)) for u in users], weights, rows, rc.round, rc, user_batch)
        p = self.privacy
        eps = epsilon_per_coordinate(p.clip_delta, p.noise_lambda) if p.ldp else float("inf")
        return frame_train_upload(users, parts), len(users), {"phase": PHASE_TRAIN, "epsilon_per_coordinate": eps}


class Server(ServerMechanism):
    """The server samples users by seed, sends each the rows of its anonymity set, checks every upload on its own
    and counts each user's uploads (the per-coordinate ledger)."""

    name = "ldp"

    def __init__(self, rounds):
        super().__init__(rounds)
        self.ledger = LDPAccountant.from_privacy(rounds.bindings.num_users, rounds.privacy, rounds.server.num_items)

    @property
    def first_round(self) -> int:
        """Round 0 carries the popularity reports of the matched sampler."""
        return 0 if self.rounds.privacy.pseudo_sampler == "popularity" else 1

    def select(self, logical_round: int, live: list[int]) -> list[int]:
        """A seeded sample of clients_per_round users (by user id)."""
        r = self.rounds
        return sample_users(r.seed, logical_round, live, r.federation.clients_per_round)

    def download(self, users, weights, table):
        """The model weights and the rows of each user's anonymity set."""
        return frame_download(weights, users, [self.rounds.server.rows_for(u) for u in users])

    def record_upload(self, user: int) -> None:
        """One more upload charged to `user`."""
        self.ledger.record_upload(user)

    def train_record(self) -> dict:
        """The per-coordinate epsilon of every upload in the round."""
        p = self.rounds.privacy
        return {"epsilon_per_coordinate": epsilon_per_coordinate(p.clip_delta, p.noise_lambda)} if p.ldp else {}

    def upload_counts(self) -> dict[str, float]:
        """From the ledger's per-user counts."""
        return self.ledger.upload_counts(sorted(self.rounds.server.anonymity_sets))

    def privacy_budget(self) -> dict | None:
        """The accounted LDP budget (`LDPAccountant.budget`). An upload's coordinates: the model's, plus one row of
        `row_width` (b_i included) per item of the set."""
        server = self.rounds.server
        model = sum(int(np.prod(s)) for s in server.model_shapes)
        return self.ledger.budget({u: model + ids.size * self.rounds.row_width
                                   for u, ids in server.anonymity_sets.items()})

    def state(self) -> dict:
        """The per-user upload counts."""
        return self.ledger.state()

    def check_resume(self, path, state: dict, train_rounds: int) -> None:
        """The per-user upload counts must be there."""
        if "uploads" not in state:
            raise CheckpointError(f"{path}: no key 'uploads'; expected the per-user upload counts of this "
                                  "privacy.mode = ldp run")

    def restore(self, state: dict) -> None:
        """Continue the upload counts."""
        self.ledger.restore(state)
