"""In-process runs checkpoint and resume as flwr runs do: a killed sweep or benchmark cell continues where it
stopped and ends with the numbers of the uninterrupted run; a checkpoint that does not fit fails in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.checkpoint import Checkpointer, CheckpointError, checkpoint_folder
from fedrec_flwr.fedgnn.state import decode_state, encode_state
from fedrec_flwr.fedgnn.user import own_items

COMMON = ("federation.rounds=6", "federation.eval_every=2", "federation.clients_per_round=20", "model.dropout=0.2")
RESUMABLE = {
    # fixed neighbours re-expanded every 2 training rounds (the service is used again after the checkpoint), the
    # popularity-matched sampler (round 0 is not re-run on resume), dropout (the torch stream must be restored)
    "expansion": ("expansion.mode=fixed", "expansion.epoch=0", "expansion.refresh_every=2",
                  "privacy.pseudo_sampler=popularity"),
    # no anonymity sets, a noise ledger that must continue
    "user_dp": ("privacy.mode=user_dp", "privacy.target_epsilon=8", "local.loss=sum", "local.batch_size=1000"),
    # private offsets started at the user's mean, item biases, a decaying Adam, b_pop in a param group of its own
    "biases": ("model.user_offset=true", "model.user_offset_init=mean", "model.item_bias=true", "server_opt.name=adam",
               "server_opt.lr_decay=0.8", "model.population_bias=true", "server_opt.population_lr=0.05",
               "model.personal_shrink=5", "model.user_offset_reg=5"),
}


def _curve(out: dict) -> list[tuple]:
    return [(h.get("phase", "train"), h.get("round"), h.get("rmse"), h.get("neighbours"), str(h.get("privacy")))
            for h in out["history"]]


@pytest.mark.parametrize("kind", list(RESUMABLE))
def test_a_killed_in_process_run_resumes_and_ends_exactly_as_the_uninterrupted_run(tiny_cfg, tmp_path, kind):
    settings = (*COMMON, *RESUMABLE[kind])
    clean = run_in_process(tiny_cfg(*settings), log_every=0)
    # checkpoints after training round 4 only (never after the last): what a run killed in round 5 or 6 leaves
    folder = tmp_path / "ckpt"
    checkpointed = run_in_process(tiny_cfg(*settings, "checkpoint.every=4", f"checkpoint.dir={folder}"), log_every=0)
    assert torch.load(folder / "server.pt", weights_only=True)["train_rounds_done"] == 4
    resumed = run_in_process(tiny_cfg(*settings, "checkpoint.resume=true", f"checkpoint.dir={folder}"), log_every=0)
    assert resumed["rmse"] == clean["rmse"] == checkpointed["rmse"]  # the same code on the same state: bit for bit
    assert _curve(resumed) == _curve(clean)  # the killed run's history, then the resumed rounds (budgets included)
    assert resumed["uploads_per_user"] == clean["uploads_per_user"]
    assert clean["resumed"] is None and resumed["wall_seconds"] > resumed["resumed"]["seconds_before"] > 0


def test_an_in_process_checkpoint_goes_under_the_runs_output_folder_unless_told(tiny_cfg, tmp_path):
    assert checkpoint_folder(tiny_cfg(f"output_dir={tmp_path / 'o'}")) == tmp_path / "o" / "checkpoint"
    assert checkpoint_folder(tiny_cfg(f"checkpoint.dir={tmp_path / 'c'}")) == tmp_path / "c"


def _with_user(blobs: list, u: int, edit) -> list:
    st = decode_state(blobs[u].numpy().tobytes())
    edit(st)
    return [*blobs[:u], torch.frombuffer(bytearray(encode_state(st)), dtype=torch.uint8), *blobs[u + 1:]]


def test_an_in_process_resume_refuses_a_checkpoint_that_does_not_fit_in_one_line(tiny_cfg, tmp_path):
    folder = tmp_path / "ckpt"
    base = ("federation.rounds=4", "federation.clients_per_round=20", f"checkpoint.dir={folder}")
    run_in_process(tiny_cfg(*base, "checkpoint.every=2"), log_every=0)
    ckpt = Checkpointer(folder)
    state = ckpt.load()
    blobs = state["user_states"]

    def item_past_the_table(st):
        st.anonymity_ids[-1] = 10_000

    own = own_items(UserPartitions(prepare_partitions(tiny_cfg(*base).data)).user(6))

    def own_item_dropped(st):
        st.anonymity_ids = np.setdiff1d(st.anonymity_ids, own[:1])

    def three_items(st):
        st.anonymity_ids = st.anonymity_ids[:3]

    first = decode_state(blobs[0].numpy().tobytes())
    cases = [
        ({"user_states": blobs[:-1]},
         "key 'user_states' is a list of 59; expected one encoded user state per user (60)"),
        ({"user_states": [*blobs[:3], blobs[3][:-1], *blobs[4:]]}, "key 'user_states[3]': stored user state of"),
        ({"user_states": [*blobs[:1], blobs[1].to(torch.int16), *blobs[2:]]},
         "key 'user_states[1]' is not a dense 1-D"),
        ({"user_states": _with_user(blobs, 5, item_past_the_table)}, "anonymity-set items; expected at least 30 sorted "
         "distinct ids in [0, 80)"),
        ({"user_states": _with_user(blobs, 6, own_item_dropped)},
         "user_states[6]' holds an anonymity set without some of the user's own items"),
        ({"user_states": _with_user(blobs, 7, three_items)}, "user_states[7]' holds 3 anonymity-set items; "
         "expected at least 30"),
        ({"user_states": _with_user(blobs, 8, lambda st: setattr(st, "handle", first.handle))},
         "user_states[8]' holds the handle of another user"),
        ({"user_states": _with_user(blobs, 9, lambda st: setattr(st, "neighbours", st.neighbours[:, :5]))},
         "user_states[9]' holds neighbours of shape (0, 5); expected at most 0 finite rows of width 16"),
        ({"user_states": _with_user(blobs, 2, lambda st: setattr(st, "offset", 0.5))},
         "user_states[2]' holds a user offset of 0.5; expected 0 (model.user_offset is off)"),
        ({"elapsed_seconds": float("inf")}, "key 'elapsed_seconds' = inf; expected the seconds"),
        ({"history": state["history"][:-1]}, "key 'history' holds 1 records; expected 2"),
        ({"train_rounds_done": 1}, "key 'train_rounds_done' = 1; expected 2"),
        ({"logical_round": 5, "train_rounds_done": 4},
         "key 'logical_round' = 5; expected a round before this run's last (5)"),
        ({"logical_round": 9}, "key 'logical_round' = 9; expected a training round of this run's schedule"),
    ]
    resume = tiny_cfg(*base, "checkpoint.resume=true")
    for change, message in cases:
        ckpt.save({**state, **change})
        with pytest.raises(CheckpointError) as err:
            run_in_process(resume, log_every=0)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    # a flwr run's server checkpoint: its users' states are on its devices, not here
    ckpt.save({k: v for k, v in state.items() if k not in ("user_states", "elapsed_seconds")})
    with pytest.raises(CheckpointError, match="was written by a flwr run, whose users' states are on the devices; "
                                              "resume it with flwr run"):
        run_in_process(resume, log_every=0)
    ckpt.save(state)  # and the checkpoint as written resumes
    assert run_in_process(resume, log_every=0)["history"][-1]["round"] == 4
