"""Launch one run: federated through `flwr run` (the simulated federation sized from the data), or the
centralized reference; the `fedrec run` command (`fedrec_flwr.cli.commands`) is its front end.

A run's results.json and rounds.csv go to its output folder, by default
outputs/<preset>-<dataset>-s<seed> (with -centralized appended for the centralized reference). A run
that fails (flwr's exit code, or the status its results.json records) raises SystemExit with the
reason; an earlier run's results in the same folder are removed first, so they are never reported.

The output folder is checked (a writable directory) and locked for the run (`fsutil.folder_lock`: a
second run into it is refused while the first is alive). Before Flower starts, the driver checks what
the ServerApp would otherwise find only after its start: the node list and, when resuming, the checkpoint
against the run's config and dataset. `flwr run`'s output is streamed to the console and copied whole to
<out>/flwr-run.log; Python tracebacks in it (the ServerApp's, when the run fails) stay in that file and
are shown on the console as one line each (`TracebackFilter`; `fedrec --debug` streams them), so the
driver's reason is the last line of a failed run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedrec_flwr.algorithms import get_algorithm
from fedrec_flwr.config import ConfigError, from_run_config, load_config, to_dict
from fedrec_flwr.data import DataError
from fedrec_flwr.data.node_files import NodeDataError
from fedrec_flwr.flower.app_source import staged_app
from fedrec_flwr.fsutil import DiskFullError, FolderError, folder_lock
from fedrec_flwr.node_list import NodeListError
from fedrec_flwr.reporting.results import RunFailed, RunRecorder

ROOT = Path(__file__).resolve().parents[2]
STARTED_RUN = re.compile(r"started run (\d+)")
UNSAFE_IN_PATH = re.compile(r"[^A-Za-z0-9._-]+")
FLWR_LOG = "flwr-run.log"  # in the output folder: `flwr run`'s whole output, tracebacks included
# the lines of a Python traceback in flwr run's output (TracebackFilter)
TRACEBACK_HEADER = re.compile(r"Traceback \(most recent call last\):\s*$")
FRAME_LINE = re.compile(r'^\s+File "[^"]*", line \d+')
CARET_LINE = re.compile(r"^\s+[\^~]+\s*$")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(\([\w.]*\))?:(\s|$)"
                            r"|^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\s*$")
RAY_ACTOR = re.compile(r"^(\x1b\[[0-9;]*m)?ray::\S+ \(pid=\d+")  # the header Ray puts before a remote traceback
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_PREFIX = re.compile(r"^\([^()]*pid=\d+[^()]*\) ?")  # a Ray worker's output: "(ClientAppActor pid=123) ..."
CHAINED = ("The above exception was the direct cause of the following exception:",
           "During handling of the above exception, another exception occurred:")
# what the user gave that is wrong: one line and exit 2 (the CLI's flags and config, data files, folders,
# node lists, results files); a run that fails exits 1 (`cli_errors_exit`)
INPUT_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError, NodeDataError, NodeListError, FolderError)


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _flwr_binary() -> str:
    local = Path(sys.executable).parent / "flwr"
    return str(local) if local.exists() else (shutil.which("flwr") or "flwr")


def federation_config(num_nodes: int, cfg) -> str:
    """flwr run's --federation-config: SuperNode count and each ClientApp's Ray resources (config keys
    simulation.num_cpus / simulation.num_gpus; a fractional GPU lets several clients share one)."""
    sim = cfg.simulation
    return (f"num-supernodes={num_nodes} client-resources-num-cpus={sim.num_cpus:g} "
            f"client-resources-num-gpus={sim.num_gpus:g}")


class TracebackFilter:
    """Holds Python tracebacks back from a stream of lines: each traceback region is replaced by the one line
    `notice(exception line)` (after whatever preceded "Traceback" on its first line, e.g. a log prefix);
    every other line passes unchanged.

    A region starts at "Traceback (most recent call last):" (ending a line), or at a frame or caret line of
    a traceback printed without its header (Ray embeds the remote one in its error's message). It runs over
    the lines a traceback is made of: indented lines (frames, code, carets, a message's continuation),
    chain headers, exception lines (`module.Name: message`), Ray's "ray::Actor.run() (pid=...)" header, and
    the line after an exception line whose message starts on the next line; blank lines inside it stay
    held until the region goes on or ends. A Ray worker's "(Actor pid=N) " prefix is ignored.
    """

    def __init__(self, notice):
        self.notice = notice
        self.inside = False
        self.lead = ""  # what preceded "Traceback" on the region's first line (a log prefix)
        self.exception = ""  # the region's latest exception line
        self.message_next = False  # the latest exception line's message starts on the next line
        self.held: list[str] = []  # blank lines inside a region: part of it, or the text after it

    def feed(self, line: str) -> list[str]:
        """The lines to show for the next line of the stream."""
        text = RAY_PREFIX.sub("", line.rstrip("\r\n"), count=1)
        header = TRACEBACK_HEADER.search(text)
        if not self.inside:
            if header or FRAME_LINE.match(text) or CARET_LINE.match(text):
                self.inside, self.exception, self.message_next, self.held = True, "", False, []
                self.lead = text[:header.start()] if header else ""
                return []
            return [line]
        if not text.strip():
            self.held.append(line)
            return []
        exception = EXCEPTION_LINE.match(text)
        if (header or text[0].isspace() or text.strip() in CHAINED or exception or RAY_ACTOR.search(text)
                or self.message_next):
            if exception:
                self.exception = text.strip()
            self.message_next = bool(exception) and text.rstrip().endswith(":")
            self.held = []
            return []
        return self.close() + self.feed(line)  # the region ended at the line before this one

    def close(self) -> list[str]:
        """The lines still held (the notice of a region the stream ended in)."""
        if not self.inside:
            return []
        shown = [self.lead + self.notice(self.exception or "an exception"), *self.held]
        self.inside, self.held = False, []
        return shown


def _traceback_notice(log_path: Path | None):
    def notice(exception: str) -> str:
        kind = exception.split(":", 1)[0].rsplit(".", 1)[-1].strip() or "exception"
        where = f"in {log_path}" if log_path is not None else "not kept"
        return f"(traceback of a {kind} hidden: the full output is {where}; `fedrec --debug run ...` shows it)\n"
    return notice


def stream_flwr_run(cmd: list[str], env: dict[str, str], log_path: Path | None = None, debug: bool = False) -> int:
    """Run `flwr run --stream`, echoing its output, and return its exit code.

    The whole output is also written to `log_path` (if given); on the console each Python traceback is
    replaced by one line naming the exception and the log (`TracebackFilter`), unless `debug`.

    `flwr run` hands the run to a background SuperLink, so killing this process alone would leave the
    simulation training. On SIGTERM or SIGINT this stops the run on the SuperLink (`flwr stop RUN_ID`),
    ends `flwr run`, and exits with 128 + the signal number.
    """
    def interrupted(signum, _frame):
        raise _Interrupted(signum)

    def show(lines: list[str]) -> None:
        for shown in lines:
            sys.stdout.write(shown)
        sys.stdout.flush()

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    run_id = None
    tracebacks = None if debug else TracebackFilter(_traceback_notice(log_path))
    log = open(log_path, "w", encoding="utf-8") if log_path is not None else None  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    try:
        for line in proc.stdout:
            if log is not None:
                log.write(line)
                log.flush()
            show([line] if tracebacks is None else tracebacks.feed(line))
            if run_id is None and (m := STARTED_RUN.search(line)):
                run_id = m.group(1)
        if tracebacks is not None:
            show(tracebacks.close())
        return proc.wait()
    except _Interrupted as stop:
        if run_id is not None:
            print(f"stopping run {run_id} on the SuperLink", flush=True)
            try:
                subprocess.run([cmd[0], "stop", run_id, "local"], env=env, cwd=ROOT, timeout=120, check=False)
            except subprocess.TimeoutExpired:
                print(f"flwr stop {run_id} did not answer in 120 s: check `flwr ls local`", flush=True)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise SystemExit(128 + stop.signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()
        if log is not None:
            log.close()


@dataclass(frozen=True)
class RunRequest:
    """What one run is asked for: preset, dataset ("" = the preset's own), seed, where the data and the cache
    are, and the overrides (`key=value`)."""

    preset: str
    dataset: str = ""
    seed: int = 0
    data_dir: str = "data"
    cache_dir: str = str(ROOT / ".cache" / "fedrec")
    overrides: tuple[str, ...] = ()
    debug: bool = False  # `fedrec --debug`: stream flwr run's tracebacks to the console too

    def config(self, *extra: str):
        """The run's validated AppConfig (data and cache folders, the overrides, then `extra`)."""
        return load_config(self.preset, self.dataset or None, [f"data.data_dir={self.data_dir}",
                                                               f"data.cache_dir={self.cache_dir}", *self.overrides,
                                                               *extra])

    def default_out(self, centralized: bool = False) -> Path:
        """outputs/<preset>-<dataset>-s<seed>[-centralized] for this request (`default_out`)."""
        dataset = self.dataset or load_config(self.preset, None, list(self.overrides)).data.name
        return default_out(self.preset, dataset, self.seed, centralized)


def run_centralized_reference(request: RunRequest, out: Path) -> dict:
    """Train the centralized reference of `request` into `out` (locked for the run); returns its final metrics."""
    from fedrec_flwr.reference.centralized import run_centralized

    cfg = request.config(f"output_dir={out}", f"seed={request.seed}")
    with folder_lock(out, "output folder"):
        return run_centralized(cfg)


def _run_config(request: RunRequest, out: Path) -> dict[str, str | int]:
    """Flower's run config of `request` (pyproject's [tool.flwr.app.config] keys), its paths made absolute."""
    run_config: dict[str, str | int] = {
        "preset": request.preset, "dataset": request.dataset, "seed": request.seed,
        "data-dir": str(Path(request.data_dir).resolve()), "cache-dir": str(Path(request.cache_dir).resolve()),
        "output-dir": str(out.resolve()), "set": " ".join(request.overrides),
    }
    for key, value in run_config.items():
        if isinstance(value, str) and "'" in value:
            raise ConfigError(f"run-config key '{key}' = {value!r} holds a single quote, which `flwr run --run-config` "
                              "cannot carry; expected a value without one (rename the folder, or use double quotes "
                              "inside --set values)")
    return run_config


# config keys that name a file or folder: True where it must exist before the run starts
PATH_KEYS = {"fppdm.secure.key_file": True, "deployment.node_list": True, "expansion.service_token_file": True,
             "expansion.ca_file": True, "data.catalogue": True, "simulation.device_secrets": False,
             "checkpoint.dir": False}


def absolute_path_overrides(overrides: list[str], cwd: Path | None = None) -> list[str]:
    """`overrides` with every path-valued one (`PATH_KEYS`) made absolute against the folder the command runs in, as
    --data-dir is (flwr run's apps run elsewhere); ConfigError naming the key and the path when one that must exist
    does not, before anything starts."""
    cwd = cwd or Path.cwd()
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in PATH_KEYS and value:
            path = Path(value).expanduser()
            path = path if path.is_absolute() else (cwd / path)
            if PATH_KEYS[key] and not path.exists():
                raise ConfigError(f"--set {key}={value}: no such file or folder ({path})")
            item = f"{key}={path.resolve()}"
        out.append(item)
    return out


def _preflight(cfg, num_nodes: int) -> None:
    """What the ServerApp would find wrong only after Flower started, by the algorithm's own pre-run check
    (`Algorithm.preflight`: the operator's node list, an input error, and a resumed run's checkpoint, which fails
    the run). `cfg` is the ServerApp's own config (`from_run_config` of the same run config)."""
    algorithm = get_algorithm(cfg.algorithm)
    if algorithm.preflight is not None:
        algorithm.part("preflight")(cfg, num_nodes, ROOT)


def run_federated(request: RunRequest, out: Path) -> dict:
    """Run the app through `flwr run` with one virtual SuperNode per `simulation.users_per_node` users (one per
    domain for FPPDM); returns results.json, or raises SystemExit with the reason when the run failed."""
    from fedrec_flwr.fedgnn.checkpoint import CheckpointError
    from fedrec_flwr.reporting.summary import ResultsFileError, read_results

    cfg = request.config()
    run_config = _run_config(request, out)
    with folder_lock(out, "output folder"):  # another live run into `out` is refused here
        num_nodes = get_algorithm(cfg.algorithm).part("nodes")(cfg)  # data prepared once here, read by every client
        # an earlier run's results are never reported as this one's
        for stale in ("results.json", "rounds.csv", FLWR_LOG):
            (out / stale).unlink(missing_ok=True)
        server_cfg = from_run_config(run_config)  # the config the ServerApp will build
        try:
            _preflight(server_cfg, num_nodes)
        except CheckpointError as exc:  # the resumed run fails as the ServerApp would fail it, and says so
            reason = f"{type(exc).__name__}: {exc}"
            RunRecorder(out, server_cfg.algorithm, server_cfg.data.name, to_dict(server_cfg)).fail(reason)
            raise SystemExit(f"federated run failed (before flwr run): {reason}") from None
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                   FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
        text = " ".join(f"{k}={v}" if isinstance(v, int) else f"{k}='{v}'" for k, v in run_config.items())
        with staged_app(ROOT, ROOT / ".cache") as app:  # the app's own files: Flower's FAB build then skips .venv
            cmd = [_flwr_binary(), "run", str(app), "local", "--stream",
                   "--federation-config", federation_config(num_nodes, cfg), "--run-config", text]
            print("+", " ".join(cmd), flush=True)
            returncode = stream_flwr_run(cmd, env, out / FLWR_LOG, request.debug)
    results = out / "results.json"
    try:
        doc = read_results(out) if results.is_file() else {}
    except ResultsFileError as exc:
        doc = {"status": "unreadable", "error": str(exc)}
    if returncode != 0 or doc.get("status") != "finished":
        why = doc.get("error") or (f"{results} says status {doc['status']!r}" if doc else f"no {results} was written")
        raise SystemExit(f"federated run failed (flwr exit {returncode}): {_reason_line(why, results)}")
    return doc


def _reason_line(why: str, results: Path) -> str:
    """A failure's reason as the driver's one last line: its first line, without terminal colours (a reason
    that quotes a client's traceback, as Ray's errors do, points at results.json for the rest)."""
    lines = ANSI.sub("", str(why)).strip().splitlines() or [""]
    return lines[0].rstrip() + (f" [...; the whole reason is in {results}]" if len(lines) > 1 else "")


def default_out(preset: str, dataset: str, seed: int, centralized: bool = False) -> Path:
    """outputs/<preset>-<dataset>-s<seed>[-centralized], each name reduced to a safe folder name
    ('disencdr:phone_elec' -> 'disencdr-phone_elec')."""
    name = "-".join(UNSAFE_IN_PATH.sub("-", part).strip("-") for part in (preset, dataset))
    return Path("outputs") / f"{name}-s{seed}{'-centralized' if centralized else ''}"


def one_line(message: str) -> str:
    """A message on one line: its lines stripped and joined by "; " (after a colon by a space), so a
    multi-line DataError's list of missing files reads as one sentence."""
    out = ""
    for part in (p.strip() for p in str(message).splitlines()):
        if part:
            out += part if not out else (" " if out.endswith(":") else "; ") + part
    return out


@contextmanager
def input_errors_exit():
    """Print an input error (`INPUT_ERRORS`: config, data, node data, node list, folder) on stderr as one line,
    without a traceback, and exit with status 2. A full disk is not an input error: it passes (exit 1 in the CLI)."""
    from fedrec_flwr.reporting.summary import ResultsFileError

    try:
        yield
    except DiskFullError:
        raise
    except (*INPUT_ERRORS, ResultsFileError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


@contextmanager
def cli_errors_exit():
    """How `fedrec` ends on an error: one line on stderr and no traceback (`fedrec --debug` re-raises instead).

    Input errors exit 2 (`input_errors_exit`); a run that fails exits 1: RunFailed, a full disk, any other
    OSError, and an unexpected exception (named as such, with the hint to rerun with --debug); Ctrl-C exits 130.
    """
    try:
        with input_errors_exit():
            yield
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except RunFailed as exc:
        print(f"error: run failed: {one_line(str(exc))}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except OSError as exc:  # DiskFullError names its folder; others name their file
        what = str(exc) if isinstance(exc, DiskFullError) else \
            f"{exc.strerror or exc}: {exc.filename}" if exc.filename else f"{type(exc).__name__}: {exc}"
        print(f"error: {one_line(what)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Exception as exc:  # noqa: BLE001  (a bug or an unforeseen input: one line, the traceback on --debug)
        print(f"error: unexpected {type(exc).__name__}: {one_line(str(exc))} (`fedrec --debug ...` shows "
              f"the traceback)",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
