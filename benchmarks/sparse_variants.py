"""Baselines on sparse and cold variants of the rating datasets (`data.train_per_user`, `data.cold_fraction`).

    python -m benchmarks.sparse_variants --data-dir ../shared/data
    python -m benchmarks.sparse_variants --data-dir ../shared/data --datasets ml-100k --targets 9 3.5 --cold 0.1
    python -m benchmarks.sparse_variants --data-dir ../shared/data --datasets douban --targets 3.5 \
        --model fedgnn_tuned --out benchmarks/results/sparse_variants_fedgnn_tuned.json
    python -m benchmarks.sparse_variants --datasets synthetic --set data.synthetic.scale=1-100 --model fedgnn_user_dp

For each dataset and each target (training ratings a user keeps on average; 0: the full split), the same test
ratings are scored by the trivial baselines and the bias model, on all of them and split by user: cold users (no
training rating), light users (1-5) and the rest, and split by item: by the training ratings the item has (none,
1-4, 5-19, 20 or more). `--set KEY=VALUE ...` overrides the config of every cell (the
synthetic generator's scale, or a model setting) and is part of the cell's key. With --model PRESET the preset's
federated model is also trained in-process on the variant, at its own settings, and scored exactly on the same
ratings per group (`run_in_process(by_group=True)`); `--shrinks K ...` also scores that final model at each of these
values of model.personal_shrink (`model_at_shrink` per group): the value weighs the prediction only, never the
training, so each is exactly what a run at that value gives. The baselines are the floor a federated model must reach on
the variant (issue: sparse and cold users). Writes benchmarks/results/sparse_variants.json (a fresh dated file when
it exists, unless --resume) and prints one Markdown row per cell. `--table FILE ...` prints the model runs of several
records side by side (a column per preset and overrides) and runs nothing; `--shrink-table FILE ...` and
`--item-table FILE ...` print the `--shrinks` runs (a column per k) and the item groups the same way.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.common import add_data_dir
from fedrec_flwr.cli.inprocess import item_groups, run_in_process
from fedrec_flwr.cli.sweep import results_file
from fedrec_flwr.config import load_config
from fedrec_flwr.data import load_from_config
from fedrec_flwr.metrics import rmse
from fedrec_flwr.reference.baselines import baseline_rmses


def groups(ds) -> dict[str, np.ndarray]:
    """The users of each group: all, cold (no training rating), light (1-5) and the rest (6 or more)."""
    per_user = np.bincount(ds.train.users, minlength=ds.num_users)
    users = np.arange(ds.num_users)
    return {"all": users, "cold": users[per_user == 0], "light": users[(per_user > 0) & (per_user <= 5)],
            "rest": users[per_user > 5]}


def load_variant(name: str, data_dir: str, target: float, cold: float, extra: list[str] = (),
                 preset: str = "fedgnn_user_dp"):
    """(dataset, label) of a variant: `name` with `target` training ratings a user and `cold` of its users cold (target
    0: the full split), `extra` data overrides: what the private baselines score, as `cell` builds it."""
    cold = cold if target else 0.0
    cfg = load_config(preset, name, [f"data.data_dir={data_dir}", f"data.train_per_user={target}",
                                     f"data.cold_fraction={cold}", *extra])
    return load_from_config(cfg.data), " ".join([name, *extra]) + (f", {target:g} a user" if target else ", full")


def group_rmses(ds, predictions: list[np.ndarray]) -> dict[str, float]:
    """Each user group's (`groups`) test RMSE of `predictions` (arrays over every test rating of `ds`, one per noise
    draw), the mean over the draws: a private baseline scored on the same ratings, per group, as the models are."""
    target = ds.test.values.astype(np.float64)
    out = {}
    for group, users in groups(ds).items():
        mask = np.isin(ds.test.users, users)
        if mask.any():
            out[group] = float(np.mean([rmse(x[mask], target[mask], ds.scale.low, ds.scale.high)
                                        for x in predictions]))
    return out


def cell(name: str, data_dir: str, target: float, cold: float, model: str | None, seed: int,
         extra: list[str] = (), shrinks: list[float] = ()) -> dict:
    """One dataset variant's facts and its baselines per user group (and the model's, with `model`, also at each
    model.personal_shrink of `shrinks`); `extra`: further config overrides."""
    cfg = load_config(model or "fedgnn_tuned", name, [f"data.data_dir={data_dir}", f"data.train_per_user={target}",
                                                      f"data.cold_fraction={cold if target else 0}", f"seed={seed}",
                                                      *extra])
    ds = load_from_config(cfg.data)
    out = {"dataset": name, "set": list(extra), "train_per_user": target, "cold_fraction": cold if target else 0.0,
           "users": ds.num_users, "train": len(ds.train), "test": len(ds.test), "groups": {}}
    for group, users in groups(ds).items():
        n = int(np.isin(ds.test.users, users).sum())
        out["groups"][group] = {"users": int(users.size), "test_ratings": n,
                                **(baseline_rmses(ds, users) if n else {})}
    out["item_groups"] = {}
    for group, items in item_groups(ds.train.items, ds.num_items).items():
        n = int(np.isin(ds.test.items, items).sum())
        out["item_groups"][group] = {"items": int(items.size), "test_ratings": n,
                                     **(baseline_rmses(ds, items=items) if n else {})}
    if model:
        run = run_in_process(cfg, log_every=50, by_group=True, group_shrinks=shrinks)
        out.update(model=model, seed=seed, rounds=cfg.federation.rounds, wall_seconds=run["wall_seconds"])
        if shrinks:
            out["shrinks"] = [float(k) for k in shrinks]
        for group, g in run["by_user_group"].items():
            out["groups"][group]["model"] = g["rmse"]
            assert g["test_ratings"] == out["groups"][group]["test_ratings"], (group, g)  # the same ratings
            if shrinks:
                out["groups"][group]["model_at_shrink"] = {k: by_group[group]["rmse"]
                                                           for k, by_group in run["by_user_group_at_shrink"].items()}
        for group, g in run["by_item_group"].items():
            out["item_groups"][group]["model"] = g["rmse"]
            assert g["test_ratings"] == out["item_groups"][group]["test_ratings"], (group, g)  # the same ratings
    return out


def model_label(cell: dict) -> str:
    """A record cell's model column name: its preset and any model overrides (data overrides name the variant)."""
    return " ".join([cell.get("model") or "-", *(x for x in cell.get("set", []) if not x.startswith("data."))])


def private_bias_column(paths: list[Path]) -> tuple[str, dict[tuple, float]]:
    """(column name, RMSE per (dataset, data overrides, target, group)) of private bias-model records
    (`benchmarks.user_dp_bias_release`, and `benchmarks.user_dp_als` at rank 0): per variant the record with the lower
    RMSE on all users, with its groups. The bias model under user-level DP at their epsilon: the baseline a model
    under that guarantee is held to."""
    cells = [c for path in paths for c in json.loads(path.read_text())["cells"] if c.get("rank", 0) == 0]
    epsilons = sorted({c["epsilon"] for c in cells})
    if len(epsilons) != 1:
        raise SystemExit(f"--private-bias records hold epsilons {epsilons}; give records of one epsilon")
    best: dict[tuple, dict] = {}
    for c in cells:
        variant = (c["dataset"], tuple(x for x in c.get("set", []) if x.startswith("data.")), c["train_per_user"])
        if variant not in best or c["rmse"] < best[variant]["rmse"]:
            best[variant] = c
    values = {(*variant, group): v for variant, c in best.items() for group, v in c["groups"].items()}
    return f"bias model, user-level DP (ε = {epsilons[0]:g}, best cell)", values


def combined_table(paths: list[Path], private_bias: list[Path] = ()) -> str:
    """One Markdown table of the records in `paths`: a row per (variant, user group) with its baselines, a column
    per model (preset and overrides) holding its RMSE on the same test ratings, at run seed 0 (the cells of other
    seeds are in the records). With `private_bias` (`benchmarks.user_dp_bias_release` records of the same variants)
    the bias model under user-level DP is a baseline column too."""
    cells = [c for path in paths for c in json.loads(path.read_text())["cells"]
             if c.get("model") and c.get("seed", 0) == 0]
    models = list(dict.fromkeys(model_label(c) for c in cells))
    private_name, private = private_bias_column(list(private_bias)) if private_bias else (None, {})
    rows: dict[tuple, dict] = {}
    for c in cells:
        for group, g in c["groups"].items():
            if g["test_ratings"] and group != "rest":  # data overrides (the scale, ...) make a variant of their own
                data_set = tuple(x for x in c.get("set", []) if x.startswith("data."))
                row = rows.setdefault((c["dataset"], data_set, c["train_per_user"], group), {"g": g})
                row[model_label(c)] = g["model"]
                if (c["dataset"], data_set, c["train_per_user"], group) in private:
                    row[private_name] = private[(c["dataset"], data_set, c["train_per_user"], group)]
    models = ([private_name] if private_name else []) + models
    lines = ["| variant | users: test ratings | global mean | user mean | bias model | " + " | ".join(models) + " |",
             "|---|---|---|---|---|" + "---|" * len(models)]
    for (name, data_set, target, group), row in rows.items():
        g = row["g"]
        variant = " ".join([name, *data_set]) + (f", {target:g} a user" if target else ", full")
        lines.append(f"| {variant} | {group} ({g['users']}): {g['test_ratings']:,} | {g['global_mean']:.4f} | "
                     f"{g['user_mean']:.4f} | {g['bias']:.4f} | "
                     + " | ".join(f"{row[m]:.4f}" if m in row else "" for m in models) + " |")
    return "\n".join(lines)


def _variant_label(cell: dict) -> str:
    """A record cell's variant: its dataset, data overrides and training ratings a user."""
    target = cell["train_per_user"]
    return " ".join([cell["dataset"], *(x for x in cell.get("set", []) if x.startswith("data."))]) + (
        f", {target:g} a user" if target else ", full")


def shrink_table(paths: list[Path]) -> str:
    """One Markdown row per (model, variant) of the records' `--shrinks` runs: the RMSE on all users at each
    model.personal_shrink, the mean over the seeds run (the lowest in bold), beside the global mean and the bias model.
    Where the preset's k sits against the others, variant by variant."""
    cells = [c for path in paths for c in json.loads(path.read_text())["cells"] if c.get("shrinks")]
    if not cells:
        raise SystemExit(f"--shrink-table {[str(p) for p in paths]}: no cell of a --shrinks run")
    rows: dict[tuple, list[dict]] = {}
    for c in cells:
        rows.setdefault((c["model"], _variant_label(c)), []).append(c)
    ks = list(cells[0]["groups"]["all"]["model_at_shrink"])
    head = " | ".join("population part alone" if float(k) >= 1e9 else f"k = {k}" for k in ks)
    lines = [f"| model | variant | seeds | global mean | bias model | {head} |",
             "|---|---|---|---|---|" + "---|" * len(ks)]
    for (model, variant), group in rows.items():
        means = [float(np.mean([c["groups"]["all"]["model_at_shrink"][k] for c in group])) for k in ks]
        best = int(np.argmin(means))
        g = group[0]["groups"]["all"]
        lines.append(f"| `{model}` | {variant} | {len(group)} | {g['global_mean']:.4f} | {g['bias']:.4f} | "
                     + " | ".join(f"**{m:.4f}**" if i == best else f"{m:.4f}" for i, m in enumerate(means)) + " |")
    return "\n".join(lines)


def item_table(paths: list[Path]) -> str:
    """One Markdown row per (variant, item group by training ratings) of the records' model runs: its items and test
    ratings, the baselines on those ratings and each model's RMSE (the mean over the seeds run) with what the group adds
    to the model's mean squared error above the bias model's on the whole variant (the groups' terms add up to the
    variant's): which items a model loses its accuracy on against the bias model."""
    cells = [c for path in paths for c in json.loads(path.read_text())["cells"]
             if c.get("model") and c.get("item_groups")]
    if not cells:
        raise SystemExit(f"--item-table {[str(p) for p in paths]}: no model cell with item groups")
    models = list(dict.fromkeys(c["model"] for c in cells))
    rows: dict[tuple, dict] = {}
    for c in cells:
        for group, g in c["item_groups"].items():
            if g["test_ratings"]:
                row = rows.setdefault((_variant_label(c), group), {"g": g})
                row.setdefault(c["model"], []).append(g["model"])
    lines = ["| variant | items rated | items: test ratings | global mean | item mean | bias model | "
             + " | ".join(f"`{m}`" for m in models) + " |", "|---|---|---|---|---|---|" + "---|" * len(models)]
    def excess(row: dict, model: str) -> float:  # the group's squared error above the bias model's, summed
        g = row["g"]
        return g["test_ratings"] * (float(np.mean(row[model])) ** 2 - g["bias"] ** 2)

    ratings: dict[str, int] = {}
    for (variant, _), row in rows.items():
        ratings[variant] = ratings.get(variant, 0) + row["g"]["test_ratings"]
    for (variant, group), row in rows.items():
        g = row["g"]
        cells_of = [f"{np.mean(row[m]):.4f} ({excess(row, m) / ratings[variant]:+.4f})" if m in row else ""
                    for m in models]
        lines.append(f"| {variant} | {group} | {g['items']:,}: {g['test_ratings']:,} | {g['global_mean']:.4f} | "
                     f"{g['item_mean']:.4f} | {g['bias']:.4f} | " + " | ".join(cells_of) + " |")
    return "\n".join(lines)


def main() -> None:
    """Every (dataset, target) cell; resumable."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--targets", nargs="+", type=float, default=[0.0, 9.0, 3.5])
    ap.add_argument("--cold", type=float, default=0.1, help="data.cold_fraction of the sparse variants")
    ap.add_argument("--model", default=None, help="also train this preset in-process on each variant")
    ap.add_argument("--seed", type=int, default=0, help="the run seed of the model (with --model)")
    ap.add_argument("--out", default="benchmarks/results/sparse_variants.json")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], dest="extra", help="config overrides of every cell")
    ap.add_argument("--shrinks", nargs="+", type=float, default=[],
                    help="with --model: also score the final model at each of these model.personal_shrink values")
    ap.add_argument("--table", nargs="+", type=Path, default=None,
                    help="only print one table of these records' model runs, a column per model")
    ap.add_argument("--shrink-table", nargs="+", type=Path, default=None,
                    help="only print the RMSE at each --shrinks value of these records' runs, a row per variant")
    ap.add_argument("--item-table", nargs="+", type=Path, default=None,
                    help="only print these records' model runs by item group (the items' training ratings)")
    ap.add_argument("--private-bias", nargs="+", type=Path, default=[],
                    help="with --table: user_dp_bias_release / user_dp_als records of the same variants, a column")
    args = ap.parse_args()
    if args.table:
        print(combined_table(args.table, args.private_bias))
        return
    if args.shrink_table or args.item_table:
        print(shrink_table(args.shrink_table) if args.shrink_table else item_table(args.item_table))
        return
    if args.shrinks and (not args.model or min(args.shrinks) < 0):
        raise SystemExit(f"--shrinks {args.shrinks}: needs --model and values >= 0 (model.personal_shrink)")
    args.shrinks = sorted(set(args.shrinks))  # one key per set of values
    if any(args.shrinks) and not load_config(args.model, args.datasets[0], args.extra).model.population_bias:
        raise SystemExit(f"--shrinks {args.shrinks}: preset {args.model} has model.population_bias = false, and k > 0 "
                         "weighs the population part it adds")
    path = results_file(Path(args.out), args.resume)
    doc = json.loads(path.read_text()) if path.exists() else {
        "command": "python -m benchmarks.sparse_variants", "machine": platform.processor() or platform.machine(),
        "date": date.today().isoformat(), "cells": []}
    def key(c: dict) -> tuple:
        return (c["dataset"], c["train_per_user"], c["cold_fraction"], tuple(c.get("set", [])), c.get("model"),
                c.get("seed") if c.get("model") else None, tuple(c.get("shrinks", [])))

    done = {key(c) for c in doc["cells"]}
    print("| dataset | per user | group | users | test ratings | global mean | user mean | item mean | bias | model |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.datasets:
        for target in args.targets:
            want = (name, target, args.cold if target else 0.0, tuple(args.extra), args.model,
                    args.seed if args.model else None, tuple(args.shrinks))
            if want not in done:
                doc["cells"].append(cell(name, args.data_dir, target, args.cold, args.model, args.seed, args.extra,
                                         args.shrinks))
                path.write_text(json.dumps(doc, indent=1) + "\n")
            c = next(c for c in doc["cells"] if key(c) == want)
            for group, g in c["groups"].items():
                if g["test_ratings"]:
                    model = f"{g['model']:.4f}" if g.get("model") is not None else "-"
                    label = " ".join([name, *args.extra])
                    print(f"| {label} | {target or 'full'} | {group} | {g['users']} | {g['test_ratings']} | "
                          f"{g['global_mean']:.4f} | {g['user_mean']:.4f} | {g['item_mean']:.4f} | {g['bias']:.4f} | "
                          f"{model} |")
                    if g.get("model_at_shrink"):
                        at = ", ".join(f"{k} -> {v:.4f}" for k, v in g["model_at_shrink"].items())
                        print(f"|  | {group}, model.personal_shrink: {at} |")
            for group, g in c.get("item_groups", {}).items():
                if g["test_ratings"]:
                    model = f"{g['model']:.4f}" if g.get("model") is not None else "-"
                    print(f"| {' '.join([name, *args.extra])} | {target or 'full'} | items rated {group} | "
                          f"{g['items']} items | {g['test_ratings']} | {g['global_mean']:.4f} | {g['user_mean']:.4f} | "
                          f"{g['item_mean']:.4f} | {g['bias']:.4f} | {model} |")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
