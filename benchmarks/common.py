"""What the measurement scripts share: the datasets folder argument, one `fedrec run` call, one in-process
FedGNN run's record, a Markdown table.

`--data-dir` defaults to `data` (relative to the folder a script runs from), the same default as
`fedrec run`: put the datasets there, laid out as docs/datasets.md says, or pass the folder.
"""

from __future__ import annotations

import argparse
import time
from datetime import date
from typing import Sequence

from fedrec_flwr.cli.sweep import fedrec_run as fedrec_run  # one `fedrec run` call in this process (re-exported)
from fedrec_flwr.cli.sweep import results_file as results_file  # where a rerun writes (re-exported)

DATA_DIR = "data"


def add_data_dir(ap: argparse.ArgumentParser) -> None:
    """The `--data-dir` argument every script that reads a registry dataset takes."""
    ap.add_argument("--data-dir", default=DATA_DIR, help="folder holding the datasets (default: ./data)")


def add_resume(ap: argparse.ArgumentParser) -> None:
    """--resume: continue the results file named by --out (its finished cells are kept, the rest run)."""
    ap.add_argument("--resume", action="store_true",
                    help="continue the --out file (skip its finished cells); without it an existing file is left "
                         "alone and the run writes a fresh one beside it")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; floats to four decimals."""
    def cell(v: object) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def in_process_record(cfg, log_every: int = 0, probe=None, record: bool = False) -> dict:
    """One FedGNN run of `cfg` in this process on one torch thread (`fedrec_flwr.cli.inprocess`: the round core and
    device code of `flwr run`): its final metrics, RMSE curve, accounted budget at the end, and times (a run
    resumed from its checkpoint counts the time its rounds took before). With a `probe` (see run_in_process),
    each number it returns is kept per evaluated round too, under `probes`. `record`: the run also writes
    results.json and rounds.csv to `cfg.output_dir`, as `fedrec run --in-process` does, for `fedrec plot`."""
    import torch

    from fedrec_flwr.cli.inprocess import run_in_process

    torch.set_num_threads(1)
    keys: set[str] = set()

    def recording(server, rmse, device_user) -> dict:
        found = probe(server, rmse, device_user)
        keys.update(found)
        return found

    started = time.time()
    out = run_in_process(cfg, log_every=log_every, probe=None if probe is None else recording, record=record)
    evals = [h for h in out["history"] if "rmse" in h]
    extra = {"probes": {k: {str(h["round"]): h[k] for h in evals if k in h} for k in sorted(keys)}} if keys else {}
    return {**extra, "sampler": cfg.privacy.pseudo_sampler,
            "final": {"rmse": out["rmse"], "eval_ratings": out["eval_ratings"], "test_ratings": out["test_ratings"]},
            "rmse_by_round": {str(h["round"]): h["rmse"] for h in evals}, "budget": evals[-1]["privacy"],
            "median_round_seconds": out["median_round_seconds"],
            "wall_seconds": round(time.time() - started + (out["resumed"] or {}).get("seconds_before", 0.0), 1),
            "resumed_after_round": (out["resumed"] or {}).get("after_round"), "date": date.today().isoformat()}
