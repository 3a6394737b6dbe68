"""`fedrec`: the product's command line.

    fedrec [--debug] run [--preset P] [--dataset D] [--data-dir DATA] [--out DIR] [--seed S] [--set key=value ...]
               [--centralized | --in-process [--device DEV]]
    fedrec config [--preset P] [--dataset D] [--set key=value ...] [--explain]
    fedrec baselines --dataset D [D ...] [--data-dir DATA]
    fedrec summary [RUN_DIR]
    fedrec plot [RUN_DIR ...] [--out DIR]
    fedrec results-page [--write]

`run` launches one run through `flwr run` (default), trains the centralized reference, or drives FedGNN's
round core in this process without Flower (`--in-process`, for sweeps); it prints the summary and, as its
last line, the final metrics as JSON. `results-page` prints the headline table that the committed results
(benchmarks/results/*.json) give, or with `--write` puts it into BENCHMARKS.md and README.md.

A run that fails exits 1 with the reason as its last line. A bad flag, setting, data file, folder, node
list or results file prints one line naming it and what was expected, and exits 2. No error prints a
traceback, unless `--debug` (before or after the command) is given: then errors are re-raised, and
`flwr run`'s tracebacks are streamed too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedrec_flwr.config import ConfigError, parse_overrides

DEFAULT_PRESET = "quickstart"  # the embedded default: FedGNN with privacy on the synthetic data
DEFAULT_DATA_DIR = "data"  # relative to the folder the command runs in (docs/datasets.md)


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line (naming the command and the flag) and exit status 2, and no
    abbreviated flags: a flag is its whole name, so a renamed one fails instead of matching another's prefix."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def _add_debug(ap: argparse.ArgumentParser, default) -> None:
    ap.add_argument("--debug", action="store_true", default=default,
                    help="re-raise errors with their traceback, and stream flwr run's tracebacks")


def _add_run_selection(ap: argparse.ArgumentParser) -> None:
    """--preset, --dataset and --set: what every command that resolves a config takes."""
    ap.add_argument("--preset", default=DEFAULT_PRESET, help=f"conf/<preset>.yaml (default {DEFAULT_PRESET})")
    ap.add_argument("--dataset", default="", help="dataset name (docs/datasets.md); default: the preset's own")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="fedrec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_debug(ap, False)
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="one run: flwr run (default), --centralized or --in-process")
    _add_run_selection(run)
    run.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="folder holding the datasets (default: ./data)")
    run.add_argument("--cache-dir", default="", help="partition cache (default: .cache/fedrec in the project)")
    run.add_argument("--out", default="", help="output folder; default: outputs/<preset>-<dataset>-s<seed> "
                     "(--in-process: its checkpoints' folder, default output_dir)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device-secrets", default="", metavar="FILE",
                     help="fix the simulated devices' secrets to FILE (created if missing, mode 600) so the run "
                          "replays bit for bit; default: each device draws its own, fresh (simulation.device_secrets)")
    how = run.add_mutually_exclusive_group()
    how.add_argument("--centralized", action="store_true", help="train the centralized reference instead")
    how.add_argument("--in-process", action="store_true", help="FedGNN's round core in this process, no Flower")
    run.add_argument("--device", default="",
                     help="--in-process only: torch device of the users (default cpu; cuda, cuda:1)")

    config = sub.add_parser("config", help="print the resolved config (--explain: where each value came from)")
    _add_run_selection(config)
    config.add_argument("--explain", action="store_true",
                        help="every value that differs from the default, with the file or override it came from")

    baselines = sub.add_parser("baselines", help="a rating split's global, user, item mean and bias-model RMSEs")
    baselines.add_argument("--dataset", nargs="+", default=["synthetic"])
    baselines.add_argument("--data-dir", default=DEFAULT_DATA_DIR)

    summary = sub.add_parser("summary", help="a finished run's summary from its results.json")
    summary.add_argument("run_dir", nargs="?", default="outputs/latest")

    plot = sub.add_parser("plot", help="PNG charts of one or more runs")
    plot.add_argument("run_dirs", nargs="*", default=["outputs/latest"])
    plot.add_argument("--out", default="", help="folder for the PNGs (default: <first run>/plots)")

    page = sub.add_parser("results-page",
                          help="the headline table of BENCHMARKS.md and README.md, from benchmarks/results")
    page.add_argument("--write", action="store_true", help="replace the marked blocks in BENCHMARKS.md and README.md")
    for command in (run, config, baselines, summary, plot, page):  # `fedrec run --debug` works as `fedrec --debug run`
        _add_debug(command, argparse.SUPPRESS)
    return ap


def _run(args: argparse.Namespace) -> None:
    from fedrec_flwr.cli.runner import (
        ROOT,
        RunRequest,
        absolute_path_overrides,
        run_centralized_reference,
        run_federated,
    )

    overrides = absolute_path_overrides(parse_overrides(" ".join(args.set)))
    if args.device_secrets:
        overrides.append(f"simulation.device_secrets={Path(args.device_secrets).resolve()}")
    request = RunRequest(args.preset, args.dataset, args.seed, args.data_dir,
                         args.cache_dir or str(ROOT / ".cache" / "fedrec"), tuple(overrides), debug=args.debug)
    if args.device and not args.in_process:
        raise ConfigError(f"--device {args.device!r} applies to --in-process runs only; expected it with --in-process "
                          "(flwr runs place clients by simulation.device and simulation.num_gpus)")
    if args.centralized and request.config(f"seed={request.seed}").checkpoint.resume:
        raise ConfigError("checkpoint.resume = true with --centralized; expected it only for flwr and --in-process "
                          "runs (--centralized runs keep no checkpoints, so the run would silently start afresh)")
    from fedrec_flwr.reporting.summary import summarize

    out = Path(args.out) if args.out else request.default_out(args.centralized)
    print(f"output folder: {out}", flush=True)
    if args.in_process:
        final = _run_in_process(request, _torch_device(args.device or "cpu"), out)
    elif args.centralized:
        final = run_centralized_reference(request, out)
    else:
        final = run_federated(request, out)["final"]
    print(summarize(str(out)), flush=True)  # every kind of run writes results.json and rounds.csv alike
    print(json.dumps(final))


def _torch_device(name: str):
    """The torch device `--device` names; ConfigError unless torch knows it and it is there."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {name!r}; expected a torch device such as cpu, cuda or cuda:1") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"--device {name!r}: torch sees {torch.cuda.device_count()} CUDA device(s); expected a "
                          "device that is present (or --device cpu)")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r}; expected cpu or cuda (the in-process users run on one of them)")
    return device


def _run_in_process(request, device, out: Path) -> dict:
    """The in-process run's final metrics and timings, its results.json and rounds.csv written to `out` (locked for
    the run) as a flwr run writes them; SystemExit with the reason when it trained nothing or its checkpoint cannot
    be resumed."""
    import torch

    from fedrec_flwr.cli.inprocess import run_in_process
    from fedrec_flwr.fedgnn.checkpoint import CheckpointError
    from fedrec_flwr.fsutil import folder_lock
    from fedrec_flwr.reporting.results import RunFailed

    torch.set_num_threads(1)
    try:
        with folder_lock(out, "output folder"):
            result = run_in_process(request.config(f"seed={request.seed}", f"output_dir={out}"), device, record=True)
    except RunFailed as exc:
        raise SystemExit(f"run failed: {exc}") from None
    except CheckpointError as exc:  # a checkpoint that cannot be resumed fails the run, as under flwr
        raise SystemExit(f"run failed: CheckpointError: {exc}") from None
    result.pop("history")
    return result


def _config(args: argparse.Namespace) -> None:
    import yaml

    from fedrec_flwr.config import explain_config, load_config, to_dict

    overrides = parse_overrides(" ".join(args.set))
    if args.explain:
        rows = explain_config(args.preset, args.dataset or None, overrides)
        width = max((len(key) for key, _, _ in rows), default=0)
        for key, value, source in rows:
            print(f"{key:{width}s}  {json.dumps(value)}  ({source})")
        return
    print(yaml.safe_dump(to_dict(load_config(args.preset, args.dataset or None, overrides)), sort_keys=False), end="")


def _baselines(args: argparse.Namespace) -> None:
    from fedrec_flwr.config import load_config
    from fedrec_flwr.data import UserPartitions, prepare_partitions
    from fedrec_flwr.reference.baselines import baseline_rmses

    print("| dataset | test ratings | global mean | user mean | item mean | bias model |")
    print("|---|---|---|---|---|---|")
    for name in args.dataset:
        cfg = load_config("fedgnn_tuned", name, [f"data.data_dir={args.data_dir}"])
        ds = UserPartitions(prepare_partitions(cfg.data)).ratings()
        r = baseline_rmses(ds)
        print(f"| {name} | {len(ds.test)} | {r['global_mean']:.4f} | {r['user_mean']:.4f} | {r['item_mean']:.4f} "
              f"| {r['bias']:.4f} |")


def _summary(args: argparse.Namespace) -> None:
    from fedrec_flwr.reporting.summary import summarize

    print(summarize(args.run_dir))


def _plot(args: argparse.Namespace) -> None:
    from fedrec_flwr.reporting.plot import plot_runs

    for path in plot_runs(args.run_dirs, args.out or str(Path(args.run_dirs[0]) / "plots")):
        print(path)


def _results_page(args: argparse.Namespace) -> None:
    from fedrec_flwr.reporting.results_page import ROOT, table, write

    if args.write:
        for path in write():
            print(f"wrote {path.relative_to(ROOT)}")
    else:
        print(table())


COMMANDS = {"run": _run, "config": _config, "baselines": _baselines, "summary": _summary, "plot": _plot,
            "results-page": _results_page}


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run the command: input errors print one line and exit 2, a failed run exits 1
    (`runner.cli_errors_exit`); with --debug every error is re-raised with its traceback."""
    from fedrec_flwr.cli.runner import cli_errors_exit

    args = _parser().parse_args(argv)
    if args.debug:
        COMMANDS[args.command](args)
        return
    with cli_errors_exit():
        COMMANDS[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
