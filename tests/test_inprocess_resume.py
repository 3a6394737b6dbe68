"""In-process runs checkpoint and resume as flwr runs do: a killed sweep or benchmark cell continues where it
stopped and ends with the numbers of the uninterrupted run; a checkpoint that does not fit fails in one line."""

from __future__ import annotations

import pytest
import torch

from fedrec_flwr.fedgnn.checkpoint import Checkpointer, CheckpointError
from fedrec_flwr.inprocess import checkpoint_folder, run_in_process

# fixed neighbours re-expanded every 2 training rounds (the service is used again after the checkpoint), the
# popularity-matched sampler (round 0 is not re-run on resume), dropout (the torch stream must be restored)
RESUMABLE = ("expansion.mode=fixed", "expansion.epoch=0", "expansion.refresh_every=2", "privacy.pseudo_sampler=popularity",
             "model.dropout=0.2", "federation.rounds=6", "federation.eval_every=2", "federation.clients_per_round=20")


def _curve(out: dict) -> list[tuple]:
    return [(h.get("phase", "train"), h.get("round"), h.get("rmse"), h.get("neighbours")) for h in out["history"]]


def test_a_killed_in_process_run_resumes_and_ends_exactly_as_the_uninterrupted_run(tiny_cfg, tmp_path):
    clean = run_in_process(tiny_cfg(*RESUMABLE), log_every=0)
    # checkpoints after training round 4 only (never after the last): what a run killed in round 5 or 6 leaves
    folder = tmp_path / "ckpt"
    checkpointed = run_in_process(tiny_cfg(*RESUMABLE, "checkpoint.every=4", f"checkpoint.dir={folder}"), log_every=0)
    assert torch.load(folder / "server.pt", weights_only=True)["train_rounds_done"] == 4
    resumed = run_in_process(tiny_cfg(*RESUMABLE, "checkpoint.resume=true", f"checkpoint.dir={folder}"), log_every=0)
    assert resumed["rmse"] == clean["rmse"] == checkpointed["rmse"]  # the same code on the same state: bit for bit
    assert _curve(resumed) == _curve(clean)  # the killed run's history, then the resumed rounds
    assert resumed["uploads_per_user"] == clean["uploads_per_user"]
    assert resumed["wall_seconds"] > 0


def test_an_in_process_checkpoint_goes_under_the_runs_output_folder_unless_told(tiny_cfg, tmp_path):
    assert checkpoint_folder(tiny_cfg(f"output_dir={tmp_path / 'o'}")) == tmp_path / "o" / "checkpoint"
    assert checkpoint_folder(tiny_cfg(f"checkpoint.dir={tmp_path / 'c'}")) == tmp_path / "c"


def _spoiled(state: dict, key: str, value) -> dict:
    return {**state, key: value}


def test_an_in_process_resume_refuses_a_checkpoint_that_does_not_fit_in_one_line(tiny_cfg, tmp_path):
    folder = tmp_path / "ckpt"
    base = ("federation.rounds=3", "federation.clients_per_round=20", f"checkpoint.dir={folder}")
    run_in_process(tiny_cfg(*base, "checkpoint.every=2"), log_every=0)
    ckpt = Checkpointer(folder)
    state = ckpt.load()
    blobs = state["user_states"]
    truncated = [*blobs[:3], blobs[3][:-1], *blobs[4:]]
    cases = [
        (_spoiled(state, "user_states", blobs[:-1]), "key 'user_states' is a list of 59; expected one encoded user state "
                                                     "per user (60)"),
        (_spoiled(state, "user_states", truncated), "key 'user_states[3]': stored user state of"),
        (_spoiled(state, "user_states", [*blobs[:1], blobs[1].to(torch.int16), *blobs[2:]]),
         "key 'user_states[1]' is not a 1-D uint8 tensor"),
        (_spoiled(state, "elapsed_seconds", -1.0), "key 'elapsed_seconds' = -1.0; expected the seconds"),
        ({k: v for k, v in state.items() if k not in ("user_states", "elapsed_seconds")},  # a flwr run's server checkpoint
         "key 'elapsed_seconds' = None"),
    ]
    resume = tiny_cfg(*base, "checkpoint.resume=true")
    for spoiled, message in cases:
        ckpt.save(spoiled)
        with pytest.raises(CheckpointError) as err:
            run_in_process(resume, log_every=0)
        assert message in str(err.value) and "\n" not in str(err.value)
    # a user state of the right layout whose item ids point past the item table
    from fedrec_flwr.fedgnn.state import decode_state, encode_state

    st = decode_state(blobs[5].numpy().tobytes())
    st.anonymity_ids[-1] = 10_000
    ckpt.save(_spoiled(state, "user_states", [*blobs[:5], torch.frombuffer(bytearray(encode_state(st)), dtype=torch.uint8),
                                              *blobs[6:]]))
    with pytest.raises(CheckpointError, match=r"user_states\[5\]' holds .* sorted distinct item ids in \[0, 80\)"):
        run_in_process(resume, log_every=0)
    ckpt.save(state)  # and the checkpoint as written resumes
    assert run_in_process(resume, log_every=0)["history"][-1]["round"] == 3
