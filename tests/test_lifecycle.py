"""The FedGNN run lifecycle (`fedgnn.lifecycle.Lifecycle`): which logical round each Flower round is, what each
does, where a resumed run continues, when it evaluates and checkpoints. The expectations are written out by hand
from the protocol (docs/protocol.md), not computed the way the lifecycle computes them."""

from __future__ import annotations

import pytest

from fedrec_flwr.config import load_config
from fedrec_flwr.fedgnn.checkpoint import CheckpointError
from fedrec_flwr.fedgnn.lifecycle import Lifecycle
from fedrec_flwr.fedgnn.protocol import (
    PHASE_EVALUATE_SUM,
    PHASE_EXPAND_FETCH,
    PHASE_EXPAND_SUBMIT,
    PHASE_POPULARITY,
    PHASE_REGISTER,
    PHASE_TRAIN,
)

R, T, E, S, F = PHASE_REGISTER, PHASE_TRAIN, PHASE_EVALUATE_SUM, PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH


def _lifecycle(*overrides: str, num_users: int = 60, first_round: int = 1, own_rounds: bool = False,
               training_rounds: int | None = None) -> Lifecycle:
    cfg = load_config("fedgnn_paper", "synthetic", list(overrides))
    return Lifecycle.for_run(cfg.federation, cfg.expansion, num_users,
                             training_rounds=training_rounds or cfg.federation.rounds, first_round=first_round,
                             evaluates_in_own_rounds=own_rounds, checkpoint_every=cfg.checkpoint.every)


def test_flower_rounds_map_onto_logical_rounds_with_and_without_a_popularity_round():
    plain = _lifecycle("federation.rounds=3")
    assert plain.schedule == (R, T, T, T) and plain.flower_rounds() == 4
    assert [plain.logical(f) for f in range(1, 5)] == [1, 2, 3, 4]
    popular = _lifecycle("federation.rounds=3", first_round=0)  # round 0 carries the popularity reports
    assert popular.flower_rounds() == 5 and [popular.logical(f) for f in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [popular.phase(popular.logical(f)) for f in range(1, 6)] == [PHASE_POPULARITY, R, T, T, T]
    with pytest.raises(ValueError, match="outside this run's rounds 1 .. 4"):
        plain.phase(0)  # no popularity round in this run
    with pytest.raises(ValueError, match="outside"):
        plain.phase(5)


def test_a_resumed_run_re_registers_then_continues_after_its_checkpoint():
    life = _lifecycle("federation.rounds=6", first_round=0)  # logical rounds 0 .. 7
    assert life.flower_rounds(resumed_after=4) == 4  # re-register, then logical 5, 6, 7
    assert [life.logical(f, resumed_after=4) for f in range(1, 5)] == [1, 5, 6, 7]
    # killed during the final evaluation: its only Flower round re-registers, then evaluates
    assert life.flower_rounds(resumed_after=7) == 1 and life.logical(1, resumed_after=7) == 1
    assert life.evaluates_at(1, train_rounds_done=6, resumed_after=7)
    assert not life.evaluates_at(1, train_rounds_done=6, resumed_after=4)  # more rounds follow: no evaluation yet


def test_evaluations_follow_every_eval_every_th_training_round_and_the_last():
    life = _lifecycle("federation.rounds=7", "federation.eval_every=3")
    after = [t for t in range(1, 8) if life.evaluates_after(t, logical_round=t + 1)]
    assert after == [3, 6, 7]
    assert [f for f in range(1, 9) if life.evaluates_at(f, train_rounds_done=f - 1)] == [4, 7, 8]
    own = _lifecycle("federation.rounds=4", "federation.eval_every=2", own_rounds=True)  # evaluate-sum rounds instead
    assert own.schedule == (R, T, T, E, T, T, E)
    assert not any(own.evaluates_after(t, logical_round=t + 1) for t in range(1, 5))


def test_a_budget_that_affords_fewer_rounds_shortens_the_schedule():
    life = _lifecycle("federation.rounds=10", "federation.eval_every=5", own_rounds=True, training_rounds=6)
    assert life.schedule == (R, T, T, T, T, T, E, T, E) and life.last_round == 9


def test_graph_expansion_rounds_sit_after_their_epochs_and_trainable_ones_refresh_later_rounds():
    # 60 users, 20 a round: an epoch is 3 training rounds, so expansion.epoch = 1 expands after training round 3
    life = _lifecycle("federation.rounds=5", "federation.clients_per_round=20", "expansion.mode=trainable",
                      "expansion.epoch=1")
    assert life.schedule == (R, T, T, T, S, F, T, T)
    assert [r for r in range(2, 9) if life.schedule[r - 1] == T and life.refreshes_neighbours(r)] == [7, 8]
    fixed = _lifecycle("federation.rounds=5", "federation.clients_per_round=20", "expansion.mode=fixed",
                       "expansion.epoch=1")
    assert not any(fixed.refreshes_neighbours(r) for r in range(1, 9))


def test_checkpoints_follow_every_checkpoint_every_th_training_round_only():
    life = _lifecycle("federation.rounds=5", "federation.clients_per_round=20", "expansion.mode=fixed",
                      "expansion.epoch=1", "checkpoint.every=2")
    done = 0
    marks = []
    for logical in range(1, life.last_round + 1):
        done += life.phase(logical) == T
        if life.checkpoints_after(logical, done):
            marks.append(logical)
    assert marks == [3, 7]  # after training rounds 2 and 4; never after registration or expansion
    assert not any(_lifecycle("federation.rounds=4").checkpoints_after(r, r - 1) for r in range(2, 6))


def test_a_checkpoint_must_sit_after_a_training_round_of_this_schedule():
    life = _lifecycle("federation.rounds=5", "federation.clients_per_round=20", "expansion.mode=fixed",
                      "expansion.epoch=1")  # R T T T S F T T
    life.check_resume_point("ckpt", 7, 4)
    for done, trained, why in ((5, 3, "expected a training round"), (1, 0, "expected a training round"),
                               (9, 5, "expected a training round"), (7, 3, "expected 4")):
        with pytest.raises(CheckpointError, match=why):
            life.check_resume_point("ckpt", done, trained)
