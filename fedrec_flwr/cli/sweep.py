"""Resumable sweeps of `fedrec run` jobs: one JSON of finished cells, skipped on a rerun.

A sweep is a list of cells, each (fields, `fedrec run` arguments): the fields name the cell (dataset,
preset, seed, ...) and are what a rerun matches finished runs by. `run_missing` runs the cells the sweep
document does not hold yet and saves the document after each, so an interrupted sweep loses at most the
run in flight and a rerun continues where it stopped. `run_record` is what a FedGNN cell may keep beside
its final metrics (its RMSE curve, neighbours and privacy budget), read from the run's results.json.
"""

from __future__ import annotations

import json
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Callable, Sequence

from fedrec_flwr.fedgnn.protocol import PHASE_TRAIN
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.reporting.results import load_results


def fedrec_run(argv: Sequence[str]) -> None:
    """`fedrec run ARGV` in this process: one run through `flwr run` (or --centralized / --in-process)."""
    from fedrec_flwr.cli.commands import main

    main(["run", *argv])


def load_sweep(out: Path, datasets: list[str], settings: dict) -> dict:
    """The sweep document at `out` (or a new one), noting the datasets and settings of this sweep."""
    doc = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    doc["datasets"] = list(dict.fromkeys([*doc.get("datasets", []), *datasets]))
    doc["settings"] = settings
    return doc


def finished(doc: dict, fields: dict) -> bool:
    """Whether the sweep document already holds a run with these fields (a rerun skips it)."""
    return any(all(r.get(k) == v for k, v in fields.items()) for r in doc["runs"])


def run_missing(doc: dict, out: Path, cells: list[tuple[dict, list[str]]], tag: str,
                extra: Callable[[dict], dict] | None = None) -> dict:
    """Run each (fields, fedrec run argv) cell whose fields are not in doc yet; save after each run.

    A run is recorded as its fields, its final metrics, `extra(results)` where given (e.g. `run_record`),
    its wall time, its command and the date. Saving per cell means an interrupted sweep loses at most the
    run in flight.
    """
    for n, (fields, argv) in enumerate(cells, 1):
        if finished(doc, fields):
            continue
        started = time.time()
        print(f"[{tag}] {n}/{len(cells)}: " + " ".join(str(v) for v in fields.values()), flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            fedrec_run([*argv, "--out", tmp])
            res = load_results(tmp)
        doc["runs"].append({**fields, "final": res["final"], **(extra(res) if extra else {}),
                            "wall_seconds": round(time.time() - started, 1),
                            "command": "fedrec run " + " ".join(argv), "date": date.today().isoformat()})
        atomic_write(out, json.dumps(doc, indent=1))
    return doc


def run_record(res: dict) -> dict:
    """What a FedGNN run keeps beside its final metrics, from its results.json (`res`): the mean neighbours
    per user after the last expansion (0 without), the RMSE after every evaluated training round (to see
    that the curve flattened; keyed by training rounds done, so registration and expansion rounds do not
    shift the keys), and the accounted privacy budget of the run ("privacy"), where it has one."""
    rounds = res.get("rounds", [])
    counts = [h["mean_neighbours"] for h in rounds if "mean_neighbours" in h]
    curve, trained = {}, 0
    for h in rounds:
        trained += h.get("phase") == PHASE_TRAIN
        if "rmse" in h:
            curve[str(trained)] = h["rmse"]
    record = {"neighbours_mean": counts[-1] if counts else 0.0, "rmse_by_round": curve}
    if res.get("privacy"):
        record["privacy"] = res["privacy"]
    return record


def results_file(path: Path, resume: bool) -> Path:
    """Where a benchmark writes: `path` when resuming it or when it does not exist yet; otherwise a fresh file beside
    it, `<stem>-<date>[-n].json`, so that a rerun of a documented command reruns every cell and never rewrites a
    committed record (printed, so the user knows where the numbers went)."""
    if resume or not path.exists():
        return path
    stem, n = f"{path.stem}-{date.today().isoformat()}", 0
    fresh = path.with_name(f"{stem}{path.suffix}")
    while fresh.exists():
        n += 1
        fresh = path.with_name(f"{stem}-{n}{path.suffix}")
    print(f"[benchmark] {path} exists (pass --resume to continue it): writing {fresh}", flush=True)
    return fresh
