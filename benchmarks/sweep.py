"""Resumable sweeps of `fedrec run` jobs: one JSON of finished cells, skipped on a rerun."""

from __future__ import annotations

import json
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Callable

from benchmarks.common import fedrec_run
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.results import load_results


def load_sweep(out: Path, datasets: list[str], settings: dict) -> dict:
    """The sweep document at `out` (or a new one), noting the datasets and settings of this sweep."""
    doc = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    doc["datasets"] = list(dict.fromkeys([*doc.get("datasets", []), *datasets]))
    doc["settings"] = settings
    return doc


def run_missing(doc: dict, out: Path, cells: list[tuple[dict, list[str]]], tag: str,
                extra: Callable[[dict], dict] | None = None) -> dict:
    """Run each (fields, fedrec run argv) cell whose fields are not in doc yet; save after each run.

    Saving per cell means an interrupted sweep loses at most the run in flight.
    """
    for n, (fields, argv) in enumerate(cells, 1):
        if any(all(r.get(k) == v for k, v in fields.items()) for r in doc["runs"]):
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
