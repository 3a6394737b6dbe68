"""Run outputs: results.json (config, per-round metrics, final metrics, wall time) and rounds.csv."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from fedrec_flwr.algorithms import ALGORITHMS
from fedrec_flwr.fsutil import atomic_write as _atomic_write


def secrets_provenance(config: dict) -> dict | None:
    """What results.json says of a run's device secrets (from its config dict; None for runs without devices'
    privacy draws): whether they were fixed, and by whom. Never the secret, nor anything computed from it."""
    algorithm = ALGORITHMS.get(str(config.get("algorithm")))
    if algorithm is None or not algorithm.privacy_modes:  # no device-side privacy draws
        return None
    if (config.get("data") or {}).get("catalogue"):  # a deployment: devices ignore the run config's path
        return {"fixed": False, "by": "each device: drawn from its OS at its first start, kept in its own "
                                      "state, never sent"}
    if (config.get("simulation") or {}).get("device_secrets"):
        return {"fixed": True, "by": "the experimenter: simulation.device_secrets, a file only the ClientApps read; "
                                     "the run replays bit for bit with it"}
    return {"fixed": False, "by": "each simulated device: drawn from the OS for this run and never sent; the run's "
                                  "privacy draws cannot be replayed"}


class RunFailed(RuntimeError):
    """A run that ended without a result it may report (nothing trained, nothing scored): the message says why."""


class RunRecorder:
    """Collects per-round records and writes them after every round, so a killed run keeps its history."""

    def __init__(self, output_dir: str | Path, algorithm: str, dataset: str, config: dict[str, Any]):
        self.output_dir = Path(output_dir)
        self.doc: dict[str, Any] = {
            "algorithm": algorithm,
            "dataset": dataset,
            "config": config,
            "rounds": [],
            "final": {},
            "wall_seconds": 0.0,
            "status": "running",
        }
        provenance = secrets_provenance(config)
        if provenance is not None:
            self.doc["device_secrets"] = provenance
        self._t0 = time.time()
        self.consoles: dict[str, RoundConsole] = {}  # tag -> its console line of the round in progress
        (self.output_dir / "rounds.csv").unlink(missing_ok=True)
        self.write()  # status "running" from the start: a results.json of an earlier run never survives

    def set_baselines(self, baselines: dict[str, float]) -> None:
        """Record the split's centralized baseline RMSEs (fedrec_flwr.reference.baselines) beside the model's."""
        self.doc["baselines"] = dict(baselines)
        self.write()

    @property
    def finished(self) -> bool:
        """True once `finish` has written the final metrics."""
        return self.doc["status"] == "finished"

    @property
    def wall_seconds(self) -> float:
        """Seconds from the recorder's start to its last write."""
        return float(self.doc["wall_seconds"])

    def history(self) -> list[dict[str, Any]]:
        """A copy of the per-round records so far."""
        return [dict(r) for r in self.doc["rounds"]]

    def restore_history(self, rounds: list[dict[str, Any]], resumed_from: int) -> None:
        """Continue a resumed run's history from its checkpoint (written after logical round `resumed_from`)."""
        self.doc["rounds"] = [dict(r) for r in rounds]
        self.doc["resumed_from"] = resumed_from
        self.write()

    def fail(self, reason: str) -> Path:
        """Mark the run failed with its reason (a failed run never reports metrics as final)."""
        self.flush_console()
        self.doc["status"] = "failed"
        self.doc["error"] = reason
        self.doc["wall_seconds"] = time.time() - self._t0
        return self.write()

    def add_round(self, record: dict[str, Any]) -> None:
        """Append or merge the record of one round (keyed by record['round'])."""
        rounds = self.doc["rounds"]
        if rounds and rounds[-1].get("round") == record.get("round"):
            rounds[-1].update(record)
        else:
            rounds.append(dict(record))
        self.doc["wall_seconds"] = time.time() - self._t0
        self.write()

    def finish(self, final: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        """Record the final metrics and total wall time; returns the results.json path."""
        self.flush_console()
        self.doc["final"] = final
        self.doc["wall_seconds"] = time.time() - self._t0
        self.doc["status"] = "finished"
        if extra:
            self.doc.update(extra)
        return self.write()

    def console(self, tag: str) -> RoundConsole:
        """The console of this run's `[tag]` round lines."""
        return self.consoles.setdefault(tag, RoundConsole(tag))

    def flush_console(self) -> None:
        """Print every round line still held (the run ends, or fails, before its round completed)."""
        for console in self.consoles.values():
            console.flush()

    def write(self) -> Path:
        """Write results.json and rounds.csv (atomically)."""
        path = self.output_dir / "results.json"
        _atomic_write(path, json.dumps(self.doc, indent=1, default=float))
        rounds = self.doc["rounds"]
        if rounds:
            keys: list[str] = []
            for r in rounds:
                keys += [k for k in r if k not in keys]
            lines = [",".join(keys)] + [",".join("" if r.get(k) is None else str(r.get(k)) for k in keys)
                                        for r in rounds]
            _atomic_write(self.output_dir / "rounds.csv", "\n".join(lines) + "\n")
        return path


def format_round(tag: str, record: dict[str, Any]) -> str:
    """One round's console line: `[tag] key=value ...`, floats to 4 decimals."""
    return f"[{tag}] " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())


class RoundConsole:
    """One console line per round: the records of a round are merged and printed once, when it completes.

    A record reported with `complete=False` (training, when the round's evaluation is still to come) is
    held; the next record of the same round joins it, and the line is printed when a record completes
    the round, when a record of another round arrives, or on `flush` (the run ends or fails).
    """

    def __init__(self, tag: str, stream=None):
        self.tag, self.stream = tag, stream
        self.pending: dict[str, Any] | None = None

    def report(self, record: dict[str, Any], complete: bool = True) -> None:
        """Add one record of a round; print the round's line if `complete`."""
        if self.pending is not None and self.pending.get("round") != record.get("round"):
            self.flush()
        self.pending = {**(self.pending or {}), **record}
        if complete:
            self.flush()

    def flush(self) -> None:
        """Print the held line, if any."""
        if self.pending is not None:
            line, self.pending = format_round(self.tag, self.pending), None
            print(line, file=self.stream or sys.stdout, flush=True)


_UNRECORDED: dict[str, RoundConsole] = {}  # consoles of round cores that run without a recorder


def report_round(recorder: "RunRecorder | None", tag: str, record: dict[str, Any], complete: bool = True) -> None:
    """Add one round's record to the run's results (if recording) and to its console line, `[tag] key=value ...`,
    printed once per round: with `complete=False` (an evaluation of the same round follows) the line waits
    for the rest of the round (RoundConsole). rounds.csv and results.json get every record as before."""
    if recorder is not None:
        recorder.add_round(record)
        console = recorder.console(tag)
    else:
        console = _UNRECORDED.setdefault(tag, RoundConsole(tag))
    console.report(record, complete)


def failure_reason(rounds_trained: int, rounds_not_applied: int, min_clients: int, rejections: list[tuple[int, str]],
                   has_result: bool, no_result: str) -> str | None:
    """Why a run must not report a result, or None: every training round it ran had fewer than `min_clients`
    accepted uploads (the last refusal named), or nothing was evaluated (`no_result` says what)."""
    if rounds_trained and rounds_not_applied == rounds_trained:
        last = rejections[-1][1] if rejections else "no upload arrived"
        return (f"no training round was applied: all {rounds_trained} had fewer than min_clients={min_clients} "
                f"accepted uploads (last refusal: {last})")
    return None if has_result else no_result


def report_final(tag: str, summary: dict[str, Any], path: Path) -> None:
    """The run's last console line: `[tag] FINAL {summary} results: PATH`."""
    print(f"[{tag}] FINAL {summary} results: {path}", flush=True)


def report_failure(tag: str, reason: str, path: Path) -> None:
    """The console line of a run that ends without a result: `[tag] FAILED: reason (results: PATH)`."""
    print(f"[{tag}] FAILED: {reason} (results: {path})", flush=True)


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a results.json (a file or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    return json.loads(p.read_text())


def records_failure(method):
    """Decorate a strategy method so that an exception marks the run's results.json failed (with the
    reason) before it propagates: a run that dies mid-way never looks finished or still running."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if getattr(self, "recorder", None) is not None:
                self.recorder.fail(f"{type(exc).__name__}: {exc}")
            raise
    return wrapper
