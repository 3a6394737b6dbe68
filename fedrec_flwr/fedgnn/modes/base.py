"""The two halves of a FedGNN privacy mode: the device-side mechanism (what a user registers, protects and uploads)
and the server-side mechanism (what the server checks, merges and accounts).

The round core (`fedgnn.rounds`), the Flower adapters and the in-process runner ask these objects and never a
mode's name; a mode module (`modes.ldp`, `modes.user_dp`) subclasses both and is registered in
`fedrec_flwr.privacy_modes`. Two shapes of upload exist, and a mode picks one per phase:
- per-user uploads, each checked on its own (`FedGNNRounds.train`, `evaluate`): the phases not in `secure_phases`;
- one secure sum over the nodes (SecAgg+; `FedGNNRounds.train_sum`, `evaluate_sum`): the phases in `secure_phases`,
  whose sums the server mechanism checks and accounts (`train_sum`, `evaluate_sum` here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from fedrec_flwr.config import PrivacyConfig
    from fedrec_flwr.fedgnn.protocol import RoundConfig


class DeviceMechanism:
    """What a user registers, protects and uploads under one privacy mode (device side)."""

    name = ""
    # the defaults are the restrictive choices: a mode opts into each looser one explicitly
    whole_table = True  # registers no anonymity set and downloads the whole item table
    expands_graph = False  # may send its embedding to a neighbour service
    plain_evaluation = False  # may send its error sums as a plain evaluation reply
    needs_terms = True  # needs the device's own terms of the run (`clients.privacy_guard.DeviceTerms`): guarded
    # with local.loss = "sum", scales the model weights' gradients by the pick's size too (not the item rows alone):
    # only where the server never sees one user's upload, since a summed loss's weight gradients saturate a
    # per-coordinate clip and show the server which rows the user rated (`fedrec_flwr.audit.attacks`)
    sums_model_loss = False

    def __init__(self, privacy: PrivacyConfig):
        self.privacy = privacy

    def reports_popularity(self) -> bool:
        """Whether a user sends an LDP popularity report before registering (round 0)."""
        return False

    def admit(self, policy: Any) -> None:
        """PolicyRefusal unless a deployed device's own policy (`DevicePolicy`) takes part in this run."""
        policy.admit_mode(self.name)

    def train_reply(self, user_of, hosted: list[int], parameters: list[np.ndarray], rc: RoundConfig,
                    num_weights: int, user_batch: int, terms: Any) -> tuple[list[np.ndarray], int, dict]:
        """(arrays, num_examples, metrics) of one node's training reply: `user_of(u)` builds hosted user u."""
        raise NotImplementedError

    def evaluation_sum_reply(self, user_of, hosted: list[int], parameters: list[np.ndarray], rc: RoundConfig,
                             num_weights: int, terms: Any) -> tuple[list[np.ndarray], int, dict]:
        """One node's evaluation vector for a secure sum; ValueError in a mode without one."""
        raise ValueError(f"an evaluate-sum round in a privacy.mode {self.name!r} run, which evaluates in plain replies")


class ServerMechanism:
    """What the server checks, merges and accounts under one privacy mode; built by the round core it serves."""

    name = ""
    secure_phases: frozenset[str] = frozenset()  # phases whose replies arrive as one secure sum over the nodes

    def __init__(self, rounds: Any):
        self.rounds = rounds  # the `fedgnn.rounds.FedGNNRounds` this mechanism serves (it builds the mechanism)
        self.budget_rounds = rounds.federation.rounds  # training rounds the privacy budget allows

    @property
    def first_round(self) -> int:
        """The first logical round: 0 when users report popularity before registering, else 1 (registration)."""
        return 1

    @property
    def evaluates_in_own_rounds(self) -> bool:
        """Whether evaluation is a round of its own (evaluate-sum) rather than a step after a training round."""
        return False

    def select(self, logical_round: int, live: list[int]) -> list[int]:
        """The users a training round asks."""
        raise NotImplementedError

    def download(self, users: list[int], weights: list[np.ndarray], table: np.ndarray | None) -> list[np.ndarray]:
        """One node's training download for `users` (`weights` and `table`, where given, read once per round)."""
        raise NotImplementedError

    def record_upload(self, user: int) -> None:
        """Charge one accepted per-user upload to its user's ledger; a mode without per-user uploads refuses."""
        raise NotImplementedError(f"privacy.mode {self.name!r} takes no per-user uploads")

    def train_record(self) -> dict:
        """Extra keys of a training round's record (its privacy terms)."""
        return {}

    def train_sum(self, logical_round: int, summed: list[np.ndarray] | None, reporting_users: int, nodes: int,
                  failures: list[str], started: float, bytes_down: float, bytes_up: float) -> dict:
        """Check, apply and account a training round's secure sum; ValueError in a mode of per-user uploads."""
        raise ValueError(f"privacy.mode {self.name!r} has no secure training sum")

    def evaluate_sum(self, logical_round: int, summed: list[np.ndarray] | None, nodes: int, failures: list[str],
                     started: float, bytes_down: float, bytes_up: float) -> dict | None:
        """Check, decode and account an evaluation's secure sum; ValueError in a mode of plain evaluation replies."""
        raise ValueError(f"privacy.mode {self.name!r} has no secure evaluation sum")

    def upload_counts(self) -> dict[str, float]:
        """How often the registered users uploaded: max, median and total."""
        raise NotImplementedError

    def privacy_budget(self) -> dict | None:
        """The budget the run has spent so far, as results.json reports it."""
        raise NotImplementedError

    def state(self) -> dict:
        """The ledger's checkpoint state."""
        raise NotImplementedError

    def check_resume(self, path, state: dict, train_rounds: int) -> None:
        """CheckpointError unless the checkpoint's ledger fits `train_rounds` training rounds done."""
        raise NotImplementedError

    def restore(self, state: dict) -> None:
        """Continue the ledger from a checkpoint's state."""
        raise NotImplementedError
