"""User-level DP (`privacy.mode = user_dp`): each user samples itself on its device, clips its whole update
(model and item-table gradient) to L2 norm C and adds its share of Gaussian noise; the server sees only the SecAgg+
sum of every node's vector, checks its norm (`fedgnn.user_dp.check_sum`), applies it over the expected sample and
charges every user each released sum, evaluations included (`accounting.UserDPAccountant`). The maths of the
vectors and checks is in `fedrec_flwr.fedgnn.user_dp`; this module is the mode's two mechanisms."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from fedrec_flwr.config import ConfigError
from fedrec_flwr.fedgnn.accounting import UserDPAccountant, sample_rate
from fedrec_flwr.fedgnn.checkpoint import CheckpointError
from fedrec_flwr.fedgnn.device_policy import charged_multiplier, floor_nodes, share_std
from fedrec_flwr.fedgnn.modes.base import DeviceMechanism, ServerMechanism
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EVALUATE_SUM,
    PHASE_TRAIN,
    frame_table_download,
    split_table_download,
)
from fedrec_flwr.fedgnn.user_dp import (
    check_sum,
    evaluation_metrics,
    node_evaluation,
    node_update,
    secagg_clipping_range,
)
from fedrec_flwr.messages import UploadRejected

if TYPE_CHECKING:
    from fedrec_flwr.config import AppConfig
    from fedrec_flwr.fedgnn.protocol import RoundConfig

log = logging.getLogger("fedrec_flwr.fedgnn")


def check_config(cfg: AppConfig) -> None:
    """The combinations user-level DP refuses, each with its reason."""
    p = cfg.privacy
    if p.secagg_threshold < 2.0 / 3.0:
        raise ConfigError(f"privacy.secagg_threshold = {p.secagg_threshold:g} is below 2/3: devices refuse such rounds "
                          "(a server that sends nodes different dropout lists could unmask one node); expected >= 0.67")
    if p.noise_multiplier <= 0 and p.target_epsilon <= 0:
        raise ConfigError("privacy.mode = 'user_dp' needs privacy.target_epsilon > 0 (sigma calibrated to it) or "
                          "privacy.noise_multiplier > 0; with neither, the sum would carry no noise")
    if p.target_epsilon <= 0 and p.eval_noise_multiplier <= 0:
        raise ConfigError("privacy.mode = 'user_dp' without privacy.target_epsilon has no budget to size its released "
                          "evaluation from; expected privacy.eval_noise_multiplier > 0")
    if cfg.expansion.mode != "none":
        raise ConfigError(f"privacy.mode = 'user_dp' with expansion.mode = {cfg.expansion.mode!r}: graph expansion "
                          "sends each user's embedding, trained on its ratings, to the neighbour service without "
                          "noise, which the user-level guarantee does not cover; set expansion.mode = none")
    if cfg.merge.robust != "mean":
        raise ConfigError(f"privacy.mode = 'user_dp' with merge.robust = {cfg.merge.robust!r}: under secure "
                          "aggregation the server sees only the sum, so a coordinate-wise median or trimmed mean "
                          "cannot be taken")
    if cfg.local.upload != "gradient":
        raise ConfigError("privacy.mode = 'user_dp' with local.upload = 'delta': use 'gradient' (the delta path "
                          "clips each local step per coordinate to privacy.clip_delta, an LDP setting)")
    if cfg.simulation.users_per_node == 0:
        raise ConfigError("privacy.mode = 'user_dp' with simulation.users_per_node = 0 (auto): the noise floor and the "
                          "SecAgg+ ranges are sized from the node count before the run; set simulation.users_per_node "
                          "(the preset's 64)")


class Device(DeviceMechanism):
    """Every hosted user is asked; those whose coin says so contribute their clipped update, and the node sends one
    vector with the noise share of all it hosts through SecAgg+. No anonymity set, no graph expansion, no plain
    evaluation: a user's error sums too leave the device only inside a noisy secure sum."""

    name = "user_dp"
    whole_table = True
    expands_graph = False
    plain_evaluation = False
    needs_terms = True
    sums_model_loss = True  # one user's update is seen only inside the noisy secure sum

    def train_reply(self, user_of, hosted, parameters, rc: RoundConfig, num_weights, user_batch, terms):
        """The node's one vector (`user_dp.node_update`); num_examples 1, so that SecAgg+'s weighted mean over the
        nodes times their number is the plain sum."""
        if terms is None:
            raise ValueError("a user-DP round on a node without its own privacy terms "
                             "(clients.privacy_guard.DeviceTerms)")
        weights, table, _ = split_table_download(parameters, num_weights)  # every hosted user is asked
        vector = node_update([user_of(u) for u in hosted], weights, table, rc.round, rc, user_batch, terms.q,
                             terms.share_std, cover=terms.policy.hides_timing)
        return vector, 1, {"phase": PHASE_TRAIN, "users": len(hosted)}

    def evaluation_sum_reply(self, user_of, hosted, parameters, rc: RoundConfig, num_weights, terms):
        """Every hosted user's clipped, normalised error sums with the node's noise share
        (`user_dp.node_evaluation`)."""
        if terms is None:
            raise ValueError("an evaluate-sum round on a node without its own privacy terms")
        weights, table, _ = split_table_download(parameters, num_weights)
        vector = node_evaluation([user_of(u) for u in hosted], weights, table, rc.round, self.privacy.eval_max_ratings,
                                 terms.eval_share_std)
        return vector, 1, {"phase": PHASE_EVALUATE_SUM, "users": len(hosted)}


class Server(ServerMechanism):
    """Asks every user, sends every node the whole table, checks and applies the secure sums and keeps the
    user-level ledger; sizes the run to its budget and its noise floor (K, the fewest nodes a released sum may
    hold)."""

    name = "user_dp"
    secure_phases = frozenset({PHASE_TRAIN, PHASE_EVALUATE_SUM})

    def __init__(self, rounds):
        super().__init__(rounds)
        privacy, federation, bindings = rounds.privacy, rounds.federation, rounds.bindings
        self.ledger = UserDPAccountant.from_privacy(privacy, federation.clients_per_round, bindings.num_users,
                                                    federation.rounds, federation.eval_every)
        self.secure_floor = floor_nodes(privacy.min_node_fraction, bindings.run_nodes)
        if self.secure_floor > bindings.run_nodes:
            raise ValueError(f"user-level DP needs at least {self.secure_floor} nodes in a secure sum "
                             f"(the noise floor), and the run has {bindings.run_nodes}; host fewer users per node")
        self.budget_rounds = self.ledger.affordable_rounds(federation.rounds)
        if self.budget_rounds < federation.rounds:
            log.warning("privacy.target_epsilon = %g allows %d of the %d training rounds at noise multiplier %.3f: "
                        "the run stops after round %d", privacy.target_epsilon, self.budget_rounds,
                        federation.rounds, self.ledger.sigma, self.budget_rounds)
        if self.budget_rounds == 0:
            raise ValueError(f"privacy.target_epsilon = {privacy.target_epsilon:g} does not allow one training round "
                             f"at noise multiplier {self.ledger.sigma:g}; raise the noise or the target")

    @property
    def evaluates_in_own_rounds(self) -> bool:
        """Evaluations are evaluate-sum rounds, through SecAgg+, charged to the budget."""
        return True

    def select(self, logical_round: int, live: list[int]) -> list[int]:
        """Every user: each samples itself on its device, so the server must not know who took part."""
        return live

    def download(self, users, weights, table):
        """The whole table, the same for every node: it tells nothing about its users."""
        return frame_table_download(weights, self.rounds.server.table() if table is None else table, users)

    def charged_multiplier(self, nodes: int, evaluation: bool = False) -> float:
        """The noise multiplier a training (or `evaluation`) sum of `nodes` node shares carries: sigma sqrt(k / K),
        K the noise floor."""
        sigma = self.ledger.eval_sigma if evaluation else self.ledger.sigma
        return charged_multiplier(sigma, nodes, self.secure_floor)

    def expected_users(self) -> float:
        """q N: how many users a round samples on average, the fixed divisor of its sum."""
        b = self.rounds.bindings
        return sample_rate(self.rounds.federation.clients_per_round, b.num_users) * b.num_users

    def secagg_clipping_ranges(self, per_node: int) -> tuple[float, float]:
        """SecAgg+'s per-coordinate ranges of a node's training and evaluation vectors
        (`user_dp.secagg_clipping_range`), for nodes of `per_node` users whose shares are sized at the noise floor."""
        p = self.rounds.privacy
        return (secagg_clipping_range(p.clip_norm, per_node,
                                      share_std(self.ledger.sigma, p.clip_norm, self.secure_floor)),
                secagg_clipping_range(1.0, per_node, share_std(self.ledger.eval_sigma, 1.0, self.secure_floor)))

    def train_sum(self, logical_round, summed, reporting_users, nodes, failures, started, bytes_down, bytes_up):
        """Check the SecAgg+ sum of the nodes' vectors (`user_dp.check_sum`), apply it over the expected sample, and
        charge every user the round at the noise the shares of its `nodes` carry. `summed` None: the secure
        aggregation produced no sum (too few nodes survived it)."""
        r = self.rounds
        for why in failures:
            r.reject(logical_round, f"client failure: {why}")
        r.train_rounds_done += 1
        applied = False
        if summed is not None and reporting_users:
            sigma = self.charged_multiplier(nodes)
            self.ledger.record_round(sigma)  # released (and so spent) whether or not it passes the check
            try:
                # a device may size its share for a stricter floor than the run's, at most every node of the run
                least = self.ledger.sigma * math.sqrt(nodes / max(r.bindings.run_nodes, 1)) * r.privacy.clip_norm
                *model, table = check_sum(summed, r.server.model_shapes, (r.server.num_items, r.server.row_width),
                                          r.privacy.clip_norm, sigma * r.privacy.clip_norm,
                                          self.expected_users(), least, r.bindings.num_users)
                applied = reporting_users >= r.federation.min_clients
            except UploadRejected as exc:
                r.reject(logical_round, f"aggregate refused: {exc}")
            if applied:
                r.server.apply_sum(model, table, self.expected_users())
        if not applied:
            r.rounds_not_applied += 1
            log.warning("round %d: no sum applied (%d users' nodes reported); model unchanged", logical_round,
                        reporting_users)
        record = {"round": logical_round, "phase": PHASE_TRAIN, "training_round": r.train_rounds_done,
                  "clients": reporting_users, "accepted": reporting_users,
                  "nodes": nodes, "rejected": r.rejected_in(logical_round), "failures": len(failures),
                  "applied": applied, "bytes_down": bytes_down, "bytes_up": bytes_up,
                  "user_epsilon": self.ledger.epsilon(), "round_seconds": time.time() - started}
        r.record(record, complete=not r.evaluates_after(logical_round))
        return record

    def evaluate_sum(self, logical_round, summed, nodes, failures, started, bytes_down, bytes_up):
        """The SecAgg+ sum of the nodes' clipped, normalised error sums (`user_dp.node_evaluation`), charged to every
        user at the noise its `nodes` shares carry, decoded into RMSE and MAE (`user_dp.evaluation_metrics`); None
        when no sum came or it was refused."""
        r = self.rounds
        for why in failures:
            r.reject(logical_round, f"client failure: {why}")
        metrics = None
        if summed is not None and nodes:
            sigma = self.charged_multiplier(nodes, evaluation=True)
            self.ledger.record_evaluation(sigma)  # released, so spent, whether or not it passes the check
            try:
                rmse, mae, weighted = evaluation_metrics(summed, r.rating_span, r.privacy.eval_max_ratings,
                                                         r.bindings.num_users, sigma)
                factor = r.unit_factor()
                r.final = {"rmse": rmse * factor, "mae": mae * factor, "eval_ratings": round(weighted),
                           "released": "noisy sum under the user-level guarantee: errors clipped at half the "
                                       f"scale, at most {r.privacy.eval_max_ratings} ratings' weight a user",
                           **({} if r.test_ratings is None else {"test_ratings": r.test_ratings})}
                r.scored_users = sorted(r.server.anonymity_sets)
                metrics = {**r.final, "eval_failures": len(failures)}
            except UploadRejected as exc:
                r.eval_rejections += 1
                r.reject(logical_round, f"evaluation sum refused: {exc}")
        record = {"round": logical_round, "phase": PHASE_EVALUATE_SUM, "nodes": nodes, "failures": len(failures),
                  "bytes_down": bytes_down, "bytes_up": bytes_up, "user_epsilon": self.ledger.epsilon(),
                  "round_seconds": time.time() - started, **(metrics or {})}
        r.record(record)
        return metrics

    def upload_counts(self) -> dict[str, float]:
        """Every user's node sends a vector every round, sampled or not."""
        n = self.ledger.rounds
        return {"max": n, "median": float(n), "total": n * len(self.rounds.server.anonymity_sets)}

    def privacy_budget(self) -> dict | None:
        """The user-level ledger (`UserDPAccountant.budget`), the planned rounds and the noise floor."""
        r = self.rounds
        return {**self.ledger.budget(), "planned_rounds": r.federation.rounds,
                "noise_floor": {"nodes": self.secure_floor, "of_nodes": r.bindings.run_nodes,
                                "min_node_fraction": r.privacy.min_node_fraction},
                "stopped_by_budget": self.budget_rounds < r.federation.rounds}

    def state(self) -> dict:
        """The released sums and their noise."""
        return self.ledger.state()

    def check_resume(self, path, state: dict, train_rounds: int) -> None:
        """The noise ledger of at most `train_rounds` released sums (a round whose secure aggregation failed
        releases none)."""
        if "user_dp_noise" not in state:
            raise CheckpointError(f"{path}: no key 'user_dp_noise'; expected the user-level privacy ledger of this "
                                  "privacy.mode = user_dp run")
        if (released := sum(n for _, n in state["user_dp_noise"])) > train_rounds:
            raise CheckpointError(f"{path}: key 'user_dp_noise' accounts for {released} released sums; expected at "
                                  f"most {train_rounds}, one per training round")

    def restore(self, state: dict) -> None:
        """Continue the ledger."""
        self.ledger.restore(state)
