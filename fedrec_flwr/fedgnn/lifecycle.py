"""The lifecycle of one FedGNN run: every logical round's phase, and how Flower's rounds, a resumed run and the
checkpoints map onto them. The one place that knows which round does what; the round core (`fedgnn.rounds`), the
Flower strategy, the ClientApp's state store and the in-process runner all ask it.

Logical rounds number the uninterrupted run: round 0 carries the popularity reports (only where the privacy mode
collects them), round 1 registers every user, then come the training rounds, with graph-expansion rounds (two
each) after T epochs and evaluate-sum rounds after every eval_every-th training round where the privacy mode
evaluates in rounds of its own. Flower numbers its rounds from 1; a resumed run's first Flower round re-registers
the users (its devices re-attach), and the next continues after the checkpoint's logical round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fedrec_flwr.config import ExpansionConfig, FederationConfig
from fedrec_flwr.fedgnn.accounting import evaluation_points
from fedrec_flwr.fedgnn.checkpoint import CheckpointError
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EVALUATE_SUM,
    PHASE_EXPAND_FETCH,
    PHASE_EXPAND_SUBMIT,
    PHASE_POPULARITY,
    PHASE_REGISTER,
    PHASE_TRAIN,
)


def round_schedule(federation: FederationConfig, expansion: ExpansionConfig, num_users: int,
                   secure_evaluation: bool = False) -> list[str]:
    """Phase of every logical round from 1: register, training rounds, and graph expansion after T epochs (again
    every `expansion.refresh_every` training rounds after that, when set). With `secure_evaluation` an evaluate-sum
    round follows every eval_every-th training round and the last.

    One epoch is ceil(users / clients_per_round) training rounds. An expansion is two rounds in which
    every user first submits to the neighbour service, then fetches its neighbours.
    """
    rounds = federation.rounds
    if secure_evaluation:  # secure-sum modes refuse graph expansion (config checks), so the two never meet
        points = set(evaluation_points(rounds, federation.eval_every))
        phases = [PHASE_REGISTER]
        for t in range(1, rounds + 1):
            phases += [PHASE_TRAIN, PHASE_EVALUATE_SUM] if t in points else [PHASE_TRAIN]
        return phases
    phases = [PHASE_REGISTER] + [PHASE_TRAIN] * rounds
    if expansion.mode != "none":
        per_epoch = -(-num_users // federation.clients_per_round)
        after = expansion.epoch * per_epoch
        if after >= rounds:
            raise ValueError(
                f"expansion.epoch = {expansion.epoch} puts graph expansion after training round {after}, "
                f"but federation.rounds = {rounds}; lower the epoch or add rounds"
            )
        every = expansion.refresh_every
        points = range(after, rounds, every) if every else [after]
        for done in reversed(points):  # from the last, so earlier positions stay put
            phases[1 + done : 1 + done] = [PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH]
    return phases


@dataclass(frozen=True)
class Lifecycle:
    """Every logical round of one run and what it is; built once per run (`for_run`)."""

    schedule: tuple[str, ...]  # the phase of logical rounds 1 .. len(schedule)
    first_round: int  # 0 with a popularity round, else 1
    eval_every: int
    evaluates_in_own_rounds: bool  # evaluate-sum rounds rather than an evaluation after a training round
    checkpoint_every: int  # training rounds between server checkpoints (0: none)
    trainable_expansion: bool  # users refresh their neighbours before they train, once they have expanded

    @classmethod
    def for_run(cls, federation: FederationConfig, expansion: ExpansionConfig, num_users: int, *, training_rounds: int,
                first_round: int, evaluates_in_own_rounds: bool, checkpoint_every: int) -> Lifecycle:
        """The lifecycle of a run of `training_rounds` training rounds (what its privacy budget allows of
        federation.rounds), with the privacy mode's first round and way of evaluating."""
        schedule = round_schedule(replace(federation, rounds=training_rounds), expansion, num_users,
                                  secure_evaluation=evaluates_in_own_rounds)
        return cls(tuple(schedule), first_round, federation.eval_every, evaluates_in_own_rounds, checkpoint_every,
                   expansion.mode == "trainable")

    # -- logical rounds ------------------------------------------------------------------
    @property
    def last_round(self) -> int:
        """The run's last logical round."""
        return len(self.schedule)

    def phase(self, logical_round: int) -> str:
        """The phase of a logical round (round 0: popularity reports, round 1: registration)."""
        if not self.first_round <= logical_round <= self.last_round:
            raise ValueError(f"logical round {logical_round} is outside this run's rounds "
                             f"{self.first_round} .. {self.last_round}")
        return PHASE_POPULARITY if logical_round == 0 else self.schedule[logical_round - 1]

    def training_rounds_through(self, logical_round: int) -> int:
        """How many training rounds the schedule has up to and including `logical_round`."""
        return self.schedule[:logical_round].count(PHASE_TRAIN)

    def evaluates_after(self, train_rounds_done: int, logical_round: int) -> bool:
        """Whether an evaluation follows the training round `logical_round`, `train_rounds_done` training rounds in:
        after every eval_every-th and after the last; never where evaluations are rounds of their own."""
        if self.evaluates_in_own_rounds or train_rounds_done <= 0:
            return False
        return train_rounds_done % self.eval_every == 0 or logical_round == self.last_round

    def checkpoints_after(self, logical_round: int, train_rounds_done: int) -> bool:
        """Whether the server checkpoints after logical round `logical_round`: a training round, every
        checkpoint.every-th."""
        every = self.checkpoint_every
        return bool(every) and self.phase(logical_round) == PHASE_TRAIN and train_rounds_done % every == 0

    def refreshes_neighbours(self, logical_round: int) -> bool:
        """Whether the users of this training round refresh their neighbours before training: trainable
        expansion, once the first expansion has fetched them."""
        return self.trainable_expansion and PHASE_EXPAND_FETCH in self.schedule[: logical_round - 1]

    # -- Flower's rounds and resuming ------------------------------------------------------
    def flower_rounds(self, resumed_after: int | None = None) -> int:
        """How many Flower rounds the run needs: all its logical rounds from the first, or, resumed after logical
        round `resumed_after`, one to re-register plus the rounds after it."""
        if resumed_after is None:
            return self.last_round - self.first_round + 1
        return self.last_round - resumed_after + 1

    def logical(self, flower_round: int, resumed_after: int | None = None) -> int:
        """The logical round a Flower round is: a resumed run re-registers in its first Flower round (logical 1),
        then continues after `resumed_after`."""
        if resumed_after is None:
            return flower_round + self.first_round - 1
        return 1 if flower_round == 1 else flower_round + resumed_after - 1

    def evaluates_at(self, flower_round: int, train_rounds_done: int, resumed_after: int | None = None) -> bool:
        """Whether Flower round `flower_round` ends with an evaluation: after the training rounds `evaluates_after`
        names, and at the end of a run resumed after its last training round (killed during the final evaluation),
        whose only round re-registers the users."""
        logical = self.logical(flower_round, resumed_after)
        if self.phase(logical) == PHASE_TRAIN:
            return self.evaluates_after(train_rounds_done, logical)
        last = flower_round == self.flower_rounds(resumed_after)
        return not self.evaluates_in_own_rounds and resumed_after is not None and last and train_rounds_done > 0

    def check_resume_point(self, path, done: int, trained: int) -> None:
        """CheckpointError unless a checkpoint written after logical round `done`, with `trained` training rounds
        done, is one this run wrote: after a training round of the schedule, with the training rounds the schedule
        has up to there."""
        if not 2 <= done <= self.last_round or self.phase(done) != PHASE_TRAIN:
            raise CheckpointError(f"{path}: key 'logical_round' = {done}; expected a training round of this run's "
                                  f"schedule (logical rounds 2 .. {self.last_round})")
        want = self.training_rounds_through(done)
        if trained != want:
            raise CheckpointError(f"{path}: key 'train_rounds_done' = {trained}; expected {want}, the training rounds "
                                  f"of this run's schedule up to logical round {done}")
