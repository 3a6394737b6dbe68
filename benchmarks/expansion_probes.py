"""FedGNN graph expansion at convergence, and why neighbours help or not: GGNN x expansion variant x seed.

    python -m benchmarks.expansion_probes --data-dir DATA --dataset ml-100k --variants fixed trainable --seeds 0 1 2
    python -m benchmarks.expansion_probes --data-dir DATA --dataset ml-100k --variants fixed-n1 fixed-n16 --seeds 0
    python -m benchmarks.expansion_probes --table benchmarks/results/expansion_probes-ml-100k.json
    python -m benchmarks.expansion_probes --plot benchmarks/results/expansion_probes-ml-100k.json \
        benchmarks/results/expansion_probes-ml-100k.png

Every cell is one in-process run (`fedrec_flwr.cli.inprocess`: the round core, device code, neighbour service
process and schedule of `flwr run`, one torch thread) of the `fedgnn_tuned` preset (GGNN, privacy on) at the
length chosen for it on a validation holdout (`benchmarks.converged_runs`: `chosen_rounds` of
converged-fedgnn_tuned-<dataset>.json, 700 rounds on ML-100K), scored on every test rating. The variants
(`VARIANTS`) differ from `none` only in their expansion settings:

- `fixed`, `trainable`: the paper's two modes (neighbours fetched once after T = 2 epochs; or every round a
  user trains, as their current embeddings);
- `fixed-refresh-K`: fixed, every user re-expanding every K training rounds;
- `fixed-nN`: at most N neighbours (10 by default);
- `fixed-random`: N neighbours drawn at random among all users instead of those sharing the most items.

At every evaluation (every 20 rounds) an expansion run also records, for the same model and users: the RMSE
with each user's neighbours left out of its graph (`rmse_without_neighbours`: what the trained model draws
from them), and for GGNN the user node's GRU update gate z (mean over users and coordinates; 1 keeps the
user's own embedding and ignores its messages) and the neighbours' share of the user's message (norm of the
neighbour part over the sum of the item and neighbour parts' norms).

`none` cells are the converged test runs themselves when converged_runs recorded them (same config, same
code: the numbers are those a rerun gives), else run here. Resumable: each finished cell is saved to
benchmarks/results/expansion_probes-<dataset>.json and skipped on a rerun; two processes may share a file
(`--seeds` or `--variants` split over two cores). A cell itself checkpoints every CHECKPOINT_EVERY training
rounds under .cache/expansion_probes/ and a rerun continues a killed cell from there, with the numbers of an
uninterrupted run (`trainable` cannot: the neighbour service's submissions are not checkpointed; `fixed-random`
draws its neighbours from the service's system randomness, once, before any checkpoint).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import numpy as np

from benchmarks.common import add_data_dir, add_resume, in_process_record, results_file
from fedrec_flwr.config import load_config
from fedrec_flwr.fedgnn.checkpoint import CheckpointError
from fedrec_flwr.fsutil import atomic_write

PRESET = "fedgnn_tuned"
EVAL_EVERY = 20
TAIL_ROUNDS = 100  # the table's steadier reading: the mean of the evaluations in the last 100 rounds
CHECKPOINT_EVERY = 50  # training rounds: at most ~4 minutes of a cell lost to a kill on a 2-core box
CHECKPOINTS = Path(".cache/expansion_probes")
VARIANTS: dict[str, list[str]] = {
    "none": ["expansion.mode=none"],
    "fixed": ["expansion.mode=fixed"],
    "trainable": ["expansion.mode=trainable"],
    "fixed-refresh-50": ["expansion.mode=fixed", "expansion.refresh_every=50"],
    "fixed-n1": ["expansion.mode=fixed", "expansion.max_neighbours=1"],
    "fixed-n4": ["expansion.mode=fixed", "expansion.max_neighbours=4"],
    "fixed-n16": ["expansion.mode=fixed", "expansion.max_neighbours=16"],
    "fixed-random": ["expansion.mode=fixed", "expansion.match=random"],
}


def neighbour_use(server, rmse, device_user) -> dict:
    """A run_in_process probe: the RMSE without neighbours, and (GGNN) the user node's update gate and the
    neighbours' share of its message, over the users that have neighbours and rated items."""
    import torch

    from fedrec_flwr.fedgnn.user import _features_of, ready, row_positions, set_weights
    from fedrec_flwr.models.dense_star import DenseStars, ggnn_user_update

    out = {"rmse_without_neighbours": rmse(neighbours=False)}
    weights, table = server.model_weights(), server.table()
    gates_with, gates_without, shares = [], [], []
    for u, ids in server.anonymity_sets.items():
        user = device_user(u)
        st, data = user.state, user.data
        if st.neighbours.shape[0] == 0 or data.train_items.size == 0:
            continue
        model = user.model
        if model.encoder.kind != "ggnn":
            return out
        set_weights(model, weights)
        ready(model, torch.device("cpu"), training=False)
        rows = user.item_rows(table[ids])
        with torch.no_grad():
            items = torch.from_numpy(rows[row_positions(st, data.train_items, user.whole_table)])
            items = model.item_input(items, _features_of(data, data.train_items, torch.device("cpu")))
            # the embedding part (the row's item-bias column, if any, is not a GNN input)
            items = items[:, : st.embedding.shape[0]]
            params = {name: p.detach()[None] for name, p in model.named_parameters()}
            neigh = torch.from_numpy(st.neighbours)[None]
            g = DenseStars(torch.from_numpy(st.embedding)[None], items[None], neigh, torch.ones(1, items.shape[0]),
                           torch.ones(1, neigh.shape[1]))
            _, z, from_neighbours = ggnn_user_update(params, g)
            _, z0, _ = ggnn_user_update(params, g._replace(neighbour_mask=torch.zeros(1, neigh.shape[1])))
            w = params["encoder.conv.weight"][:, 0]
            from_items = torch.bmm(items.sum(0)[None, None], w)[:, 0]
        gates_with.append(float(z.mean()))
        gates_without.append(float(z0.mean()))
        n_norm, i_norm = float(from_neighbours.norm()), float(from_items.norm())
        shares.append(n_norm / max(n_norm + i_norm, 1e-12))
    if gates_with:
        out.update(update_gate=float(np.mean(gates_with)), update_gate_without_neighbours=float(np.mean(gates_without)),
                   neighbour_message_share=float(np.mean(shares)))
    return out


def cell_name(dataset: str, variant: str, seed: int) -> str:
    """The folder name of one cell's checkpoint."""
    return f"{dataset}-{variant}-seed{seed}"


def cell_checkpoint(dataset: str, variant: str, seed: int) -> list[str]:
    """The checkpoint settings of one cell: every CHECKPOINT_EVERY training rounds into its own folder, resumed
    when a killed run of it left a checkpoint there; none for `trainable`, which cannot resume."""
    if "expansion.mode=trainable" in VARIANTS[variant]:
        return []
    folder = CHECKPOINTS / cell_name(dataset, variant, seed)
    resume = ["checkpoint.resume=true"] if (folder / "server.pt").is_file() else []
    return [f"checkpoint.dir={folder}", f"checkpoint.every={CHECKPOINT_EVERY}", *resume]


def chosen_rounds(dataset: str, results: Path) -> tuple[int, dict[int, dict]]:
    """The preset's validation-chosen length on `dataset`, and converged_runs' test runs at it by seed."""
    path = results / f"converged-{PRESET}-{dataset}.json"
    if not path.is_file():
        raise SystemExit(f"{path} not found: run `python -m benchmarks.converged_runs --dataset {dataset}` first, "
                         "which chooses the number of rounds on a validation holdout")
    doc = json.loads(path.read_text())
    rounds = int(doc["chosen_rounds"])
    tests = {r["seed"]: r for r in doc["runs"] if r["holdout"] == "test" and r["rounds"] == rounds
             and r["overrides"] == ["data.holdout=test", f"federation.rounds={rounds}",
                                    f"federation.eval_every={EVAL_EVERY}"]}
    return rounds, tests


def tail_mean(curve: dict[str, float], rounds: int) -> float:
    """The mean of a curve's evaluations in the last TAIL_ROUNDS rounds: steadier than the last one, which moves
    by up to 0.003 from one evaluation to the next with the users sampled in the rounds before it."""
    return float(np.mean([v for k, v in curve.items() if int(k) >= rounds - TAIL_ROUNDS]))


def table(doc: dict) -> str:
    """Markdown: per variant, the final test RMSE (mean +- std over seeds), its difference from `none` (mean over
    the variant's seeds of the difference from none's run of the same seed) at the end and over the last
    TAIL_ROUNDS rounds, the RMSE without neighbours (minus the RMSE with them, over the same tail), the gate and the
    neighbours' share, and the wall time of a run."""
    by = {}
    for r in doc["runs"]:
        by.setdefault(r["variant"], []).append(r)
    rounds = doc["rounds"]
    base = {r["seed"]: r for r in by.get("none", [])}
    lines = [f"{doc['dataset']}, {rounds} rounds (final test RMSE; seeds in brackets; tail: the mean of the "
             f"evaluations in the last {TAIL_ROUNDS} rounds)\n",
             "| variant | RMSE | - none (same seeds) | - none, tail | RMSE without neighbours | without - with, tail "
             "| update gate z (without) | neighbours' message share | mean neighbours | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        runs = sorted(by.get(name, []), key=lambda r: r["seed"])
        if not runs:
            continue
        finals = [r["final"]["rmse"] for r in runs]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        paired = [r for r in runs if r["seed"] in base and name != "none"]  # against none's run of the same seed

        def vs_none(value) -> str:  # mean over the paired seeds of value(run) - value(none's run of the same seed)
            return f"{statistics.mean(value(r) - value(base[r['seed']]) for r in paired):+.4f}" if paired else ""

        diff = vs_none(lambda r: r["final"]["rmse"])
        diff_tail = vs_none(lambda r: tail_mean(r["rmse_by_round"], rounds))
        used = [tail_mean(r["probes"]["rmse_without_neighbours"], rounds) - tail_mean(r["rmse_by_round"], rounds)
                for r in runs if r.get("probes", {}).get("rmse_without_neighbours")]

        def last(key: str) -> float | None:
            vals = [list(r.get("probes", {}).get(key, {}).values()) for r in runs]
            vals = [v[-1] for v in vals if v]
            return statistics.mean(vals) if vals else None

        without, z, z0, share = (last(k) for k in ("rmse_without_neighbours", "update_gate",
                                                   "update_gate_without_neighbours", "neighbour_message_share"))
        gate = f"{z:.3f} ({z0:.3f})" if z is not None else ""
        rmse = f"{finals[0]:.4f} [seed {runs[0]['seed']}]" if len(runs) == 1 else \
            f"{statistics.mean(finals):.4f} ± {sd:.4f} [{len(runs)}]"
        lines.append(f"| {name} | {rmse} | {diff} | {diff_tail} | "
                     + (f"{without:.4f}" if without is not None else "") + " | "
                     + (f"{statistics.mean(used):+.4f}" if used else "") + f" | {gate} | "
                     + (f"{share:.3f}" if share is not None else "") + " | "
                     + f"{statistics.mean(r.get('neighbours_mean', 0.0) for r in runs):.1f} | "
                     + f"{statistics.median(r['wall_seconds'] for r in runs):.0f} |")
    return "\n".join(lines + ["", per_seed_table(doc)])


def paired_interval(diffs: list[float]) -> tuple[float, float]:
    """The 95% Student-t interval of the mean of paired differences (one per seed): whether a variant's effect
    against `none` is told apart from zero by the seeds measured, not just by its mean."""
    from scipy import stats

    half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return statistics.mean(diffs) - half, statistics.mean(diffs) + half


def per_seed_table(doc: dict) -> str:
    """Markdown: per expansion cell, its difference from `none` of the same seed (final and tail) and what leaving
    its neighbours out costs the same model (tail); every other variant also against `fixed` of the same seed, the
    protocol it changes (the same sampled users, but for `fixed-refresh-K` after its first refresh); per variant with
    two or more paired seeds, the 95% interval of the mean tail difference from `none`."""
    rounds = doc["rounds"]
    base = {r["seed"]: r for r in doc["runs"] if r["variant"] == "none"}
    fixed = {r["seed"]: r for r in doc["runs"] if r["variant"] == "fixed"}
    lines = ["| variant | seed | - none, final | - none, tail | - fixed, final | - fixed, tail "
             "| without neighbours - with, tail |", "|---|---|---|---|---|---|---|"]
    intervals = []
    for name in VARIANTS:
        runs = sorted((r for r in doc["runs"] if r["variant"] == name and name != "none"), key=lambda r: r["seed"])
        tails = []
        for r in runs:
            tail = tail_mean(r["rmse_by_round"], rounds)
            without = r.get("probes", {}).get("rmse_without_neighbours")
            used = f"{tail_mean(without, rounds) - tail:+.4f}" if without else ""
            cells = []
            for ref in (base, fixed if name != "fixed" else {}):
                other = ref.get(r["seed"])
                cells += ["", ""] if other is None else [
                    f"{r['final']['rmse'] - other['final']['rmse']:+.4f}",
                    f"{tail - tail_mean(other['rmse_by_round'], rounds):+.4f}"]
            if r["seed"] in base:
                tails.append(tail - tail_mean(base[r["seed"]]["rmse_by_round"], rounds))
            lines.append(f"| {name} | {r['seed']} | {' | '.join(cells)} | {used} |")
        if len(tails) > 1:
            low, high = paired_interval(tails)
            intervals.append(f"{name} - none, tail, {len(tails)} seeds: {statistics.mean(tails):+.4f} "
                             f"(95% t interval {low:+.4f} ... {high:+.4f})")
    nones = list(base.values())
    spread = ""
    if len(nones) > 1:
        spread = (f"none's seed spread (std): {statistics.stdev(r['final']['rmse'] for r in nones):.4f} final, "
                  f"{statistics.stdev(tail_mean(r['rmse_by_round'], rounds) for r in nones):.4f} tail")
    return "\n".join(lines + [""] + intervals + ([spread] if spread else []))


def plot(doc: dict, path: Path) -> None:
    """Two panels over training rounds, one line per expansion cell: its test RMSE minus the `none` run of the same
    seed (solid) and the same model's RMSE without its neighbours minus it (dotted); and the GGNN user node's update
    gate z with (solid) and without (dotted) its neighbours, with the neighbours' share of its message."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    none = {r["seed"]: r["rmse_by_round"] for r in doc["runs"] if r["variant"] == "none"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    palette = plt.get_cmap("tab20")  # 20 distinct colours: one per cell, where the default cycle repeats after 10
    for i, r in enumerate(sorted((r for r in doc["runs"] if r["variant"] != "none"),
                                 key=lambda r: (r["variant"], r["seed"]))):
        color, label = palette(i % 20), f"{r['variant']}, seed {r['seed']}"
        base = none.get(r["seed"], {})
        probes = r.get("probes", {})
        for key, curve, ls in (("rmse", r["rmse_by_round"], "-"),
                               ("without", probes.get("rmse_without_neighbours", {}), ":")):
            pts = sorted((int(k), v - base[k]) for k, v in curve.items() if k in base)
            if pts:
                left.plot([x for x, _ in pts], [y for _, y in pts], ls=ls, color=color,
                          label=label if key == "rmse" else None, lw=1)
        for key, ls in (("update_gate", "-"), ("update_gate_without_neighbours", ":")):
            pts = sorted((int(k), v) for k, v in probes.get(key, {}).items())
            right.plot([x for x, _ in pts], [y for _, y in pts], ls=ls, color=color, lw=1,
                       label=f"{label}: gate z" if ls == "-" else None)
        pts = sorted((int(k), v) for k, v in probes.get("neighbour_message_share", {}).items())
        right.plot([x for x, _ in pts], [y for _, y in pts], ls="--", color=color, lw=1,
                   label=f"{label}: neighbours' share")
    left.axhline(0.0, color="black", lw=0.8)
    left.set_title(f"{doc['dataset']}, {doc['rounds']} rounds: test RMSE - none of the same seed\n"
                   "dotted: the same model without its neighbours - none", fontsize=9)
    right.set_title("GGNN user node: update gate z (dotted: without its neighbours)\n"
                    "dashed: the neighbours' share of its message", fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("training round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    left.set_ylim(-0.006, 0.006)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Run the missing cells of the requested variants and seeds; print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--dataset", default="ml-100k")
    ap.add_argument("--variants", nargs="+", default=["none", "fixed", "trainable"], choices=list(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, help="default: the length converged_runs chose on validation")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    add_resume(ap)
    ap.add_argument("--table", type=Path, metavar="JSON", help="only print this results file as markdown")
    ap.add_argument("--plot", type=Path, nargs=2, metavar=("JSON", "PNG"), help="only plot this results file")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.plot:
        plot(json.loads(args.plot[0].read_text()), args.plot[1])
        return
    found = (args.results / f"converged-{PRESET}-{args.dataset}.json").is_file()
    rounds, converged = chosen_rounds(args.dataset, args.results) if found or not args.rounds else (args.rounds, {})
    rounds = args.rounds or rounds
    out = results_file(args.results / f"expansion_probes-{args.dataset}.json", args.resume)
    doc = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    doc.update(dataset=args.dataset, preset=PRESET, rounds=rounds, eval_every=EVAL_EVERY,
               command=f"python -m benchmarks.expansion_probes --data-dir DATA --dataset {args.dataset}")
    for seed in args.seeds:
        for name in args.variants:
            overrides = ["data.holdout=test", f"federation.rounds={rounds}", f"federation.eval_every={EVAL_EVERY}",
                         *VARIANTS[name]]
            if out.is_file():  # another process may have finished cells meanwhile
                doc["runs"] = json.loads(out.read_text())["runs"]
            if any(r["variant"] == name and r["seed"] == seed and r["overrides"] == overrides for r in doc["runs"]):
                continue
            if name == "none" and seed in converged and rounds == converged[seed]["rounds"]:
                record = {**converged[seed], "source": f"converged-{PRESET}-{args.dataset}.json"}
            else:
                print(f"[expansion_probes] {args.dataset} {name} seed {seed}: {' '.join(overrides)}", flush=True)
                cfg = load_config(PRESET, args.dataset, [f"data.data_dir={args.data_dir}", f"seed={seed}", *overrides,
                                                         *cell_checkpoint(args.dataset, name, seed)])
                mean_neighbours = []

                def probe(server, rmse, device_user):
                    found = neighbour_use(server, rmse, device_user) if cfg.expansion.mode != "none" else {}
                    counts = [device_user(u).state.neighbours.shape[0] for u in server.anonymity_sets]
                    mean_neighbours.append(float(np.mean(counts)))
                    # the log keeps them as they come
                    print(f"[expansion_probes] probe {json.dumps(found)}", flush=True)
                    return found

                try:
                    record = in_process_record(cfg, log_every=1, probe=probe)
                except CheckpointError as exc:
                    raise SystemExit(f"{exc} (left by an earlier run of this cell, which this one cannot continue: "
                                     f"delete {cfg.checkpoint.dir} to run the cell afresh)") from None
                record["neighbours_mean"] = mean_neighbours[-1]
            record.update(variant=name, seed=seed, overrides=overrides)
            if out.is_file():
                doc["runs"] = json.loads(out.read_text())["runs"]
            doc["runs"].append(record)
            atomic_write(out, json.dumps(doc, indent=1))
            # saved: nothing to resume
            shutil.rmtree(CHECKPOINTS / cell_name(args.dataset, name, seed), ignore_errors=True)
            print(f"[expansion_probes] {args.dataset} {name} seed {seed}: test RMSE {record['final']['rmse']:.4f}",
                  flush=True)
    print(table(doc))


if __name__ == "__main__":
    main()
