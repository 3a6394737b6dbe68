"""The results page: the headline table of BENCHMARKS.md (and its short form in README.md), generated from
the committed results, benchmarks/results/*.json.

    fedrec results-page            # print the table
    fedrec results-page --write    # replace the marked blocks in BENCHMARKS.md and README.md

Every row is declared in `ROWS`: which JSON under benchmarks/results holds its runs, which runs
(field filters), which number of a run, and the parts no JSON records: the paper's figure, the
privacy budget and the command of one run. The cell "this project" is the mean ± sample standard
deviation (n - 1) over the selected runs, one per seed, and the number of seeds. A command is
`fedrec run --preset P --dataset D --data-dir DATA [--seed S]` and nothing more: a
dataset's own settings are in conf/datasets/<dataset>.yaml, and the output folder is the driver's
default, outputs/<preset>-<dataset>-s<seed>. The pages and the results are those of the project's checkout
(`ROOT`, the folder above this package).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedrec_flwr.fsutil import atomic_write

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# (file, start marker, end marker, rows: all or only the README's, columns)
BLOCKS = (
    ("BENCHMARKS.md", "<!-- headline:start -->", "<!-- headline:end -->", "full"),
    ("README.md", "<!-- headline-readme:start -->", "<!-- headline-readme:end -->", "readme"),
)

FEDGNN_LDP_MATCHED = "LDP ε = 1 per coordinate of one upload (δ = 0.1, λ = 0.2), popularity-matched pseudo items"
# the headline fedgnn_tuned rows: re-recorded with every draw from the devices' own secrets
FEDGNN_LDP_SECRET = FEDGNN_LDP_MATCHED + ", device-secret noise"
USER_DP = ("user-level ε ≤ 8 over the run, training and its one released evaluation (δ = 1e-5; noise floor at 0.8 "
           "of the nodes), add or remove one user; SecAgg+ sums only, device-secret noise")
NO_PRIVACY = "none (centralized)"
# FedGNN (Wu et al. 2021, Table 3) and its journal version FedPerGNN (Wu et al., Nature Communications 2022),
# both with their privacy (pseudo items + per-coordinate LDP)
ML100K_PAPERS = "0.920 / 0.910 (FedGNN / FedPerGNN, with privacy)"
DOUBAN_PAPERS = "0.790 / 0.775 (FedGNN / FedPerGNN, with privacy)"
FPPDM_NONE = "no DP (users' μ, σ sent in plaintext)"


@dataclass(frozen=True)
class Row:
    """One headline row: where its runs are, which number, and the declared columns."""

    algorithm: str
    dataset: str
    metric: str
    source: str                      # file name under benchmarks/results
    where: dict[str, Any]            # a run is selected when every field equals the value given
    value: str                       # dotted path of the number inside a run, e.g. "final.rmse"
    paper: str
    budget: str
    command: str                     # one seed's command; its output folder is fedrec run's default
    readme: bool = False


def _fppdm_rows() -> list[Row]:
    rows = []
    names = {"single_domain": "single-domain training (baseline)",
             "fppdm": "FPPDM", "fppdm_pp": "FPPDM++"}
    for dataset, label, k in (("douban-book-music", "Douban Book + Music", 5),
                              ("amazon-phone-elec", "Amazon Phone + Elec", 10),
                              ("amazon-cloth-sport", "Amazon Cloth + Sport", 10)):
        for preset in ("single_domain", "fppdm", "fppdm_pp"):
            rows.append(Row(
                algorithm=names[preset], dataset=label,
                metric=f"HR@{k} (mean of the 2 domains)",
                source="fppdm_table.json", where={"dataset": dataset, "preset": preset},
                value=f"final.hr@{k}", paper="-", budget=FPPDM_NONE,
                command=f"fedrec run --preset {preset} --dataset {dataset} --data-dir DATA --seed S",
                readme=(preset in ("single_domain", "fppdm_pp") and dataset == "amazon-phone-elec"),
            ))
    return rows


ROWS: tuple[Row, ...] = (
    Row(algorithm="FedGNN, `fedgnn_tuned` (GGNN + biases, ids only)", dataset="ML-100K (u1)",
        metric="test RMSE after 700 rounds (chosen on a validation holdout)",
        source="ldp-mean-weights/converged-fedgnn_tuned-ml-100k.json", where={"holdout": "test", "rounds": 700},
        value="final.rmse", paper=ML100K_PAPERS, budget=FEDGNN_LDP_SECRET,
        command="fedrec run --preset fedgnn_tuned --dataset ml-100k --data-dir DATA --seed S",
        readme=True),
    Row(algorithm="FedGNN, `fedgnn_features` (`fedgnn_tuned` + public genres, 1,000 rounds)",
        dataset="ML-100K (u1)",
        metric="test RMSE after 1,000 rounds", source="fedgnn_features.json",
        where={"dataset": "ml-100k", "privacy": True, "rounds": 1000, "sampler": "popularity"}, value="final.rmse",
        paper="0.920 / 0.910 (FedGNN / FedPerGNN, ids only, with privacy)",
        budget=FEDGNN_LDP_SECRET,
        command="fedrec run --preset fedgnn_features --dataset ml-100k --data-dir DATA --seed S",
        readme=True),
    Row(algorithm="FedGNN, `fedgnn_tuned` (GGNN + biases, ids only)", dataset="Douban (sRGCNN 3000 x 3000)",
        metric="test RMSE after 300 rounds (chosen on a validation holdout)",
        source="ldp-map-terms/converged-fedgnn_tuned-douban.json", where={"holdout": "test", "rounds": 300},
        value="final.rmse", paper=DOUBAN_PAPERS, budget=FEDGNN_LDP_SECRET,
        command="fedrec run --preset fedgnn_tuned --dataset douban --data-dir DATA --seed S",
        readme=True),
    Row(algorithm="FedGNN, `fedgnn_user_dp` (GGNN + biases, d = 4, ids only)", dataset="ML-100K (u1)",
        metric="test RMSE after 100 rounds (every test rating, exact: the simulation's; the server gets "
               "a noisy release)",
        source="user_dp_curve.json",
        where={"dataset": "ml-100k", "target_epsilon": 8.0, "rounds": 100, "extra": []}, value="final.rmse",
        paper="0.920 / 0.910 (FedGNN / FedPerGNN, per-coordinate LDP only)", budget=USER_DP,
        command="fedrec run --preset fedgnn_user_dp --dataset ml-100k --data-dir DATA --seed S", readme=True),
    Row(algorithm="FedGNN, `fedgnn_user_dp` (GGNN + biases, d = 4, ids only)", dataset="Douban (sRGCNN 3000 x 3000)",
        metric="test RMSE after 100 rounds (every test rating, exact: the simulation's; the server gets "
               "a noisy release)",
        source="user_dp_curve.json",
        where={"dataset": "douban", "target_epsilon": 8.0, "rounds": 100, "extra": []}, value="final.rmse",
        paper="0.790 / 0.775 (FedGNN / FedPerGNN, per-coordinate LDP only)", budget=USER_DP,
        command="fedrec run --preset fedgnn_user_dp --dataset douban --data-dir DATA --seed S", readme=True),
    Row(algorithm="centralized reference (FedGNN's GAT model, all ratings in one place)", dataset="ML-100K (u1)",
        metric="test RMSE after 40 epochs", source="centralized.json", where={"dataset": "ml-100k"},
        value="rmse", paper="0.905 (GC-MC, centralized)", budget=NO_PRIVACY,
        command="fedrec run --preset fedgnn_paper --dataset ml-100k --data-dir DATA --centralized --seed S"),
    Row(algorithm="centralized reference (FedGNN's GAT model, all ratings in one place)",
        dataset="Douban (sRGCNN 3000 x 3000)", metric="test RMSE after 40 epochs", source="centralized.json",
        where={"dataset": "douban"}, value="rmse", paper="0.734 (GC-MC, centralized)", budget=NO_PRIVACY,
        command="fedrec run --preset fedgnn_paper --dataset douban --data-dir DATA --centralized --seed S"),
    *_fppdm_rows(),
)

FULL_COLUMNS = ("algorithm", "dataset", "metric", "this project (mean ± std, seeds)", "paper", "privacy budget",
                "command (one seed)", "source")
README_COLUMNS = ("algorithm", "dataset", "metric", "this project (mean ± std, seeds)", "paper")


def load(source: str) -> dict:
    """One results JSON, by file name."""
    return json.loads((RESULTS / source).read_text())


def runs(doc: dict) -> list[dict]:
    """The per-run records of a results JSON, in one shape.

    Sweeps and run lists (`runs`: fedgnn_tuned, fedgnn_features, fppdm_table, expansion_table) give
    their runs, with `rounds` = the last evaluated round where the run records `rmse_by_round`;
    centralized.json gives each dataset's per-seed runs with the dataset added.
    """
    if "runs" in doc:
        out = []
        for run in doc["runs"]:
            rec = dict(run)
            if isinstance(run.get("rmse_by_round"), dict) and run["rmse_by_round"]:
                rec["rounds"] = max(int(k) for k in run["rmse_by_round"])
            out.append(rec)
        return out
    if "results" in doc:
        return [{"dataset": r["dataset"], **run} for r in doc["results"] for run in r["runs"]]
    raise ValueError("a results JSON without 'runs' or 'results'")


def pick(record: dict, path: str) -> Any:
    """record['final']['rmse'] for path 'final.rmse'; None where any part is missing."""
    value: Any = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def selected(row: Row) -> list[dict]:
    """The runs of a row: every filter matches and the number is there."""
    return [r for r in runs(load(row.source))
            if all(r.get(k) == v for k, v in row.where.items()) and isinstance(pick(r, row.value), (int, float))]


def values(row: Row) -> list[float]:
    """The row's numbers, one per seed; an empty or duplicated selection is an error."""
    chosen = selected(row)
    if not chosen:
        raise ValueError(f"{row.source}: no run matches {row.where} with a number at {row.value!r}")
    seeds = [r.get("seed", 0) for r in chosen]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{row.source}: {row.where} selects seeds {seeds}, more than one run per seed")
    return [float(pick(r, row.value)) for r in chosen]


def measured(row: Row) -> str:
    """'0.7783 ± 0.0033 (3 seeds)' or '0.9432 (1 seed)'."""
    vals = values(row)
    if len(vals) == 1:
        return f"{vals[0]:.4f} (1 seed)"
    return f"{statistics.mean(vals):.4f} ± {statistics.stdev(vals):.4f} ({len(vals)} seeds)"


def command(row: Row) -> str:
    """The row's command: the preset, the dataset (whose conf/datasets/<dataset>.yaml holds any
    per-dataset settings) and the seed; nothing else."""
    return row.command


def cells(row: Row) -> dict[str, str]:
    """The row's cells by column name: declared text, the measured cell and the command and source as code."""
    return {"algorithm": row.algorithm, "dataset": row.dataset, "metric": row.metric,
            "this project (mean ± std, seeds)": measured(row), "paper": row.paper, "privacy budget": row.budget,
            "command (one seed)": f"`{command(row)}`", "source": f"`{row.source}`"}


def table(which: str = "full") -> str:
    """The markdown table: every row ('full', BENCHMARKS.md) or the README's rows ('readme')."""
    columns = FULL_COLUMNS if which == "full" else README_COLUMNS
    rows = ROWS if which == "full" else [r for r in ROWS if r.readme]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        c = cells(row)
        lines.append("| " + " | ".join(c[col] for col in columns) + " |")
    return "\n".join(lines)


def block(start: str, end: str, which: str) -> str:
    """Markers and the generated table between them, as they stand in the file."""
    return f"{start}\n{table(which)}\n{end}"


def current_block(text: str, start: str, end: str) -> str:
    """The marked block of a file's text, markers included."""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"markers {start} ... {end} not found in order")
    return text[i:j + len(end)]


def write() -> list[Path]:
    """Replace every marked block with the generated table; return the files changed."""
    changed = []
    for name, start, end, which in BLOCKS:
        path = ROOT / name
        text = path.read_text()
        new = text.replace(current_block(text, start, end), block(start, end, which))
        if new != text:
            atomic_write(path, new)
            changed.append(path)
    return changed
