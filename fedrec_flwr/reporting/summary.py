"""The final summary of a run from its results.json (`fedrec run` prints it; `fedrec summary` too).

`read_results` is how `fedrec summary` and `fedrec plot` read a run's results.json: every key they use is
checked first, so a missing, foreign or hand-edited file gives one ResultsFileError naming the file, the
key and what was expected, never a KeyError or a formatting error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedrec_flwr.reference.baselines import best_trivial

STATUSES = ("running", "finished", "failed")
# round keys that plots draw and the summary sums: numbers (or null) when present
ROUND_NUMBERS = ("rmse", "mae", "hr@5", "ndcg@5", "hr@10", "ndcg@10", "round_seconds", "bytes_up", "bytes_down")
EXPECTED = "the results.json a run writes in its output folder"


class ResultsFileError(ValueError):
    """A results.json that cannot be summarised or plotted; the message names the file, the key and what was
    expected."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_results(file: Path, doc: Any) -> dict:
    """`doc` (a parsed results.json) if it holds what the summary and the plots read; ResultsFileError otherwise."""
    def fail(key: str, value: Any, expected: str) -> None:
        shown = json.dumps(value)
        raise ResultsFileError(f"{file}: key '{key}' = {shown if len(shown) <= 60 else shown[:57] + '...'}; "
                               f"expected {expected}")

    if not isinstance(doc, dict):
        raise ResultsFileError(f"{file}: a JSON {type(doc).__name__}; expected an object ({EXPECTED})")
    for key in ("algorithm", "dataset", "status"):
        if key not in doc:
            raise ResultsFileError(f"{file}: no key '{key}'; expected {EXPECTED}")
        if not isinstance(doc[key], str):
            fail(key, doc[key], "a string")
    if doc["status"] not in STATUSES:
        fail("status", doc["status"], f"one of {STATUSES}")
    if "error" in doc and not isinstance(doc["error"], str):
        fail("error", doc["error"], "a string (why the run failed)")
    rounds = doc.get("rounds", [])
    if not isinstance(rounds, list):
        fail("rounds", rounds, "a list of round records")
    for i, record in enumerate(rounds):
        if not isinstance(record, dict):
            fail(f"rounds[{i}]", record, "a round record (an object)")
        if not _number(record.get("round")):
            fail(f"rounds[{i}].round", record.get("round"), "the round's number")
        for key in ROUND_NUMBERS:
            if record.get(key) is not None and not _number(record[key]):
                fail(f"rounds[{i}].{key}", record[key], "a number or null")
    if doc["status"] != "finished":
        return doc  # a running or failed run is summarised by its status and error only
    if "wall_seconds" not in doc or not _number(doc["wall_seconds"]):
        fail("wall_seconds", doc.get("wall_seconds"), "the run's wall time in seconds")
    final = doc.get("final")
    if not isinstance(final, dict):
        fail("final", final, "an object of final metrics")
    for key, value in final.items():
        if not (_number(value) or isinstance(value, str) or value is None):
            fail(f"final.{key}", value, "a number")
    for key in ("eval_ratings", "test_ratings"):
        if final.get(key) is not None and not _integer(final[key]):
            fail(f"final.{key}", final[key], "an integer count of test ratings")
    for key in ("rounds_not_applied", "baseline_ratings"):
        if doc.get(key) is not None and not _integer(doc[key]):
            fail(key, doc[key], "an integer")
    baselines = doc.get("baselines")
    if baselines:
        if not isinstance(baselines, dict) or not all(_number(v) for v in baselines.values()):
            fail("baselines", baselines, "an object of baseline RMSEs (numbers)")
        if final.get("rmse") is not None:
            missing = [k for k in ("global_mean", "user_mean", "item_mean") if k not in baselines]
            if missing:
                fail("baselines", baselines,
                     f"the trivial baselines global_mean, user_mean and item_mean (missing {missing})")
    privacy = doc.get("privacy")
    if privacy and isinstance(privacy, dict) and "epsilon" in privacy:  # a user-level ledger: one epsilon for all
        try:
            numbers = [privacy["delta"], privacy["epsilon"], privacy["noise_multiplier"], privacy["sample_rate"],
                       privacy["clip_norm"], privacy["rounds"], privacy["epsilon_at_1_over_n"]["epsilon"],
                       privacy["epsilon_at_1_over_n"]["delta"]]
            ok = isinstance(privacy["neighbouring"], str) and all(_number(v) for v in numbers)
        except (KeyError, TypeError):
            ok = False
        if not ok:
            fail("privacy", privacy, "the user-level budget (neighbouring, delta, epsilon, noise_multiplier, "
                                     "sample_rate, clip_norm, rounds, epsilon_at_1_over_n)")
    elif privacy:
        try:
            numbers = [privacy["delta"], privacy["epsilon_per_coordinate_per_upload"],
                       privacy["per_upload"]["coordinates"], privacy["per_upload"]["basic"],
                       privacy["per_upload"]["tight"],
                       *(privacy["per_user_run"][w][k] for w in ("median", "max") for k in ("basic", "tight"))]
            ok = isinstance(privacy["neighbouring"], str) and all(_number(v) for v in numbers)
            ok = ok and all("uploads" in privacy["per_user_run"][w] for w in ("median", "max"))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            fail("privacy", privacy, "the accounted budget (neighbouring, delta, epsilon_per_coordinate_per_upload, "
                                     "per_upload, per_user_run.median / .max)")
    return doc


def read_results(path: str | Path) -> dict:
    """A run's results.json (`path`: its output folder, or the file), checked by `check_results`."""
    p = Path(path)
    if not p.exists():
        raise ResultsFileError(f"run {path}: no such folder or file; expected a run's output folder (holding "
                               "results.json) or its results.json")
    file = p / "results.json" if p.is_dir() else p
    if not file.is_file():
        raise ResultsFileError(f"{file}: no such file; expected {EXPECTED} (is {path} a run's output folder?)")
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ResultsFileError(f"{file}: not UTF-8 text (at byte {exc.start}); expected {EXPECTED}") from None
    except json.JSONDecodeError as exc:
        raise ResultsFileError(f"{file}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                               f"expected {EXPECTED}") from None
    except OSError as exc:
        raise ResultsFileError(f"{file}: cannot be read ({exc.strerror}); expected {EXPECTED}") from None
    return check_results(file, doc)

_BASELINE_NAMES = {"global_mean": "global mean", "user_mean": "user mean", "item_mean": "item mean",
                   "bias": "bias (mean + user + item bias)"}


def summarize(path: str) -> str:
    """A short summary: final metrics beside the split's baselines, rounds, wall time, traffic, privacy."""
    doc = read_results(path)
    if doc.get("status") != "finished":  # a failed or unfinished run has no result to show
        return f"{doc['algorithm']} on {doc['dataset']}: {doc.get('status')}: {doc.get('error', 'no final metrics')}"
    rounds = [r for r in doc.get("rounds", []) if r.get("phase") == "train" or "train_loss" in r]
    final = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in doc["final"].items()
                      if not isinstance(v, str))
    up = [r["bytes_up"] for r in rounds if r.get("bytes_up") is not None]
    down = [r["bytes_down"] for r in rounds if r.get("bytes_down") is not None]
    lines = [
        f"{doc['algorithm']} on {doc['dataset']} ({doc.get('status')}): {final}",
        f"  training rounds: {len(rounds)}, wall: {doc['wall_seconds']:.1f}s",
    ]
    if doc.get("rounds_not_applied"):
        lines.append(f"  {doc['rounds_not_applied']} of {len(rounds)} training rounds were not applied "
                     "(fewer than min_clients accepted uploads)")
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    data_cfg = config.get("data") if isinstance(config.get("data"), dict) else {}
    held = "validation" if data_cfg.get("holdout") == "validation" else "test"  # which ratings were scored
    if held == "validation":
        lines.append(f"  scored on the validation holdout ({data_cfg.get('validation_fraction')} of each user's "
                     "training ratings, data.holdout=validation), not on the test ratings")
    scored, total = doc["final"].get("eval_ratings"), doc["final"].get("test_ratings")
    if isinstance(doc["final"].get("released"), str):  # user-level DP: what the server learns is a noisy release
        lines.append(f"  evaluation released under the user-level guarantee: {doc['final']['released']} (about "
                     f"{scored:,} weighted ratings of the split's {total if total is not None else '?'}); the "
                     "baselines below are exact")
    elif scored is not None and total is not None:
        lines.append(f"  {held} ratings scored: {scored:,} of the split's {total:,}")
    baselines = doc.get("baselines")
    rmse = doc["final"].get("rmse")
    if baselines:
        on = doc.get("baseline_ratings")
        lines.append(f"  {held} RMSE of centralized baselines (no federation, no privacy) on "
                     + (f"the same {on:,} {held} ratings:" if on is not None else "the same split:"))
        lines += [f"    {_BASELINE_NAMES.get(k, k):32s} {v:.4f}" for k, v in baselines.items()]
        if rmse is not None:
            best = best_trivial(baselines)
            change = 100 * (1 - rmse / best)
            lines.append(f"  model {rmse:.4f} is {abs(change):.1f}% {'below' if change >= 0 else 'above (worse than)'} "
                         f"the best trivial baseline ({best:.4f})")
    budget = doc.get("privacy")
    if budget and "epsilon" in budget:  # a user-level ledger: every user spends the same epsilon
        n = budget["epsilon_at_1_over_n"]
        lines.append(f"  privacy ({budget['neighbouring']}): user-level epsilon {budget['epsilon']:.3g} at delta "
                     f"{budget['delta']:g} ({n['epsilon']:.3g} at delta 1/N = {n['delta']:.2g}) over "
                     f"{budget['rounds']} rounds; noise multiplier {budget['noise_multiplier']:.3g}, clip "
                     f"{budget['clip_norm']:g}, sampling rate {budget['sample_rate']:.3g}")
    elif budget:
        one, run = budget["per_upload"], budget["per_user_run"]
        lines.append(f"  privacy ({budget['neighbouring']}; tight = RDP at delta {budget['delta']:g}):")
        lines.append(f"    epsilon {budget['epsilon_per_coordinate_per_upload']:g} per coordinate of one upload")
        lines.append(f"    one upload ({one['coordinates']:,} coordinates): {one['basic']:.4g} basic, "
                     f"{one['tight']:.4g} tight")
        for which in ("median", "max"):
            r = run[which]
            lines.append(f"    {which} user over the run ({r['uploads']} uploads): {r['basic']:.4g} basic, "
                         f"{r['tight']:.4g} tight"
                         + (f" ({r['tight_at_1_over_n']['epsilon']:.4g} at delta 1/N)" if "tight_at_1_over_n" in r
                            else ""))
    secrets = doc.get("device_secrets")
    if isinstance(secrets, dict) and isinstance(secrets.get("by"), str):
        lines.append(f"  device secrets: {'fixed' if secrets.get('fixed') else 'fresh'}, by {secrets['by']}")
    if up and down:
        lines.append(f"  per client per round: {sum(up) / len(up) / 1e6:.3f} MB up, "
                     f"{sum(down) / len(down) / 1e6:.3f} MB down")
    lines.append(f"  results: {path}/results.json")
    return "\n".join(lines)
