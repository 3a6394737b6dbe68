"""One clear error for every bad input: each class of input a user can give (the CLI's flags and settings,
Flower's run config, data files, cache and output folders, node lists, checkpoints, results files) fails
with one line naming the thing and what was expected, exit 2 (an input error) or 1 (a run that fails),
and no traceback unless `fedrec --debug`; a failed `flwr run` ends with the driver's reason, its
tracebacks kept in the output folder's flwr-run.log."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fedrec_flwr.cli.runner as runner
import fedrec_flwr.data.partition as partition
import fedrec_flwr.fsutil as fsutil
from fedrec_flwr.cli.commands import main as cli_main
from fedrec_flwr.cli.runner import RunRequest, TracebackFilter, stream_flwr_run
from fedrec_flwr.config import ConfigError, from_run_config, load_config, to_dict
from fedrec_flwr.data import DataError, load_dataset, prepare_partitions
from fedrec_flwr.fedgnn.checkpoint import Checkpointer, CheckpointError, StateShapes
from fedrec_flwr.fsutil import LOCK_FILE, DiskFullError, FolderError, folder_lock
from fedrec_flwr.node_list import NodeListError, load_node_list
from fedrec_flwr.reporting.summary import ResultsFileError, read_results

ROOT = Path(__file__).resolve().parent.parent
TINY = ["data.synthetic.num_users=12", "data.synthetic.num_items=40", "data.synthetic.mean_degree=8", "model.dim=8",
        "privacy.pseudo_items=10", "federation.rounds=1", "federation.clients_per_round=4"]
needs_superlink = pytest.mark.skipif(
    shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
    reason="flower-superlink not installed next to this Python",
)


def fails(argv: list[str], capsys, code: int = 2) -> str:
    """`fedrec ARGV` exits `code` with one line on stderr and no traceback; returns that line."""
    with pytest.raises(SystemExit) as stop:
        cli_main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def tiny_run(tmp_path, *extra: str) -> list[str]:
    """`fedrec run` arguments of a tiny synthetic FedGNN run under tmp_path, plus `extra` settings."""
    return ["run", "--preset", "fedgnn_paper", "--dataset", "synthetic", "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "out"), "--set", *TINY, *extra]


# -- the CLI and Flower's run config --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["run", "--seed", "x"], "error: fedrec run: argument --seed: invalid int value: 'x' (see `fedrec run --help`)"),
    (["run", "--colour", "red"], "error: fedrec: unrecognized arguments: --colour red (see `fedrec --help`)"),
    (["frobnicate"], "error: fedrec: argument command: invalid choice: 'frobnicate'"),
    (["run", "--centralized", "--in-process"], "error: fedrec run: argument --in-process: not allowed with argument"),
])
def test_a_bad_flag_is_one_line_and_exit_2(argv, message, capsys):
    assert fails(argv, capsys).startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["config", "--preset", "nope"], "error: unknown preset 'nope': no file"),
    (["config", "--set", "federation.rounds"], "error: override 'federation.rounds' is not of the form key=value"),
    (["config", "--set", "model.colour=3"], "model.colour"),
    (["run", "--device", "cuda"], "error: --device 'cuda' applies to --in-process runs only"),
    (["run", "--in-process", "--device", "tpu9"], "error: --device 'tpu9'; expected a torch device"),
    (["run", "--centralized", "--set", "checkpoint.resume=true"], "error: checkpoint.resume = true with --centralized"),
])
def test_a_bad_setting_is_one_line_and_exit_2(argv, message, capsys):
    assert message in fails(argv, capsys)


@pytest.mark.parametrize("run_config, message", [
    ({"colour": "red"}, "unknown run-config key(s) ['colour']"),
    ({"seed": "seven"}, "run-config key 'seed' = 'seven'; expected an integer"),
    ({"seed": 1.5}, "run-config key 'seed' = 1.5; expected an integer"),
    ({"set": "federation.rounds='3"}, "run-config key 'set': overrides"),
    ({"set": "federation.rounds=0"}, "config key 'federation.rounds' = 0; expected >= 1"),
    ({"preset": "nope"}, "unknown preset 'nope'"),
])
def test_a_bad_flower_run_config_names_its_key_on_one_line(run_config, message):
    with pytest.raises(ConfigError) as err:
        from_run_config({"preset": "fedgnn_paper", **run_config})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_path_in_set_resolves_as_the_data_folder_does_and_a_missing_one_is_one_line(tmp_path, capsys, monkeypatch):
    """`--set fppdm.secure.key_file=KEY` with KEY relative: resolved against the folder the command runs in (flwr
    run's apps run elsewhere), and checked before anything starts."""
    from fedrec_flwr.cli.runner import absolute_path_overrides

    monkeypatch.chdir(tmp_path)
    (tmp_path / "KEY").write_text("k")
    assert absolute_path_overrides(["fppdm.secure.key_file=KEY", "federation.rounds=2"]) == [
        f"fppdm.secure.key_file={tmp_path / 'KEY'}", "federation.rounds=2"]
    line = fails(["run", "--preset", "fppdm", "--set", "fppdm.secure.enabled=true", "fppdm.secure.key_file=NOPE"],
                 capsys)
    assert line.startswith("error: --set fppdm.secure.key_file=NOPE: no such file") and str(tmp_path / "NOPE") in line


def test_a_run_config_value_flwr_cannot_carry_is_refused_before_anything_runs(tmp_path, capsys):
    line = fails(["run", "--out", str(tmp_path / "it's"), "--set", *TINY], capsys)
    assert line.startswith("error: run-config key 'output-dir' = ") and "single quote" in line
    assert not (tmp_path / "it's").exists()


def test_debug_re_raises_instead_of_one_line(tmp_path):
    for argv in (["--debug", "summary", str(tmp_path / "none")], ["summary", "--debug", str(tmp_path / "none")]):
        with pytest.raises(ResultsFileError, match="no such folder or file"):
            cli_main(argv)


def test_an_unexpected_error_is_one_line_exit_1_and_points_at_debug(monkeypatch, capsys):
    def broken(args):
        raise TypeError("a bug")

    monkeypatch.setitem(__import__("fedrec_flwr.cli.commands").cli.commands.COMMANDS, "summary", broken)
    line = fails(["summary"], capsys, code=1)
    assert line == "error: unexpected TypeError: a bug (`fedrec --debug ...` shows the traceback)"
    with pytest.raises(TypeError):
        cli_main(["--debug", "summary"])


# -- data files ---------------------------------------------------------------------------------------------

SPLIT = {  # dataset -> files of a small valid copy: {relative path: lines}
    "ml-100k": {"ml-100k/u1.base": ["1\t1\t5\t0", "1\t2\t4\t0", "2\t1\t3\t0", "2\t3\t4\t0"],
                "ml-100k/u1.test": ["1\t3\t2\t0", "2\t2\t5\t0"]},
    "ml-1m": {"ml-1m/ratings.dat": [f"{u}::{i}::{1 + (u + i) % 5}::0" for u in range(1, 6) for i in range(1, 5)]},
    "douban-book-music": {f"douban_gadtcdr/{d}/ratings.dat": ["1\t1\t5", "1\t2\t4", "2\t1\t5", "2\t3\t4"]
                          for d in ("douban_book", "douban_music")},
    "disencdr:a_b": {f"disencdr_amazon/{f}/{n}": (["0\t1", "0\t2", "1\t0"] if n == "train.txt" else ["0\t3"])
                     for f in ("a_b", "b_a") for n in ("train.txt", "test.txt")},
}
DUPLICATED = {"ml-100k": "ml-100k/u1.base", "ml-1m": "ml-1m/ratings.dat",
              "douban-book-music": "douban_gadtcdr/douban_music/ratings.dat",
              "disencdr:a_b": "disencdr_amazon/b_a/train.txt"}


def _write(root: Path, name: str, edit=None) -> Path:
    for rel, lines in SPLIT[name].items():
        lines = edit(rel, list(lines)) if edit else lines
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize("name", SPLIT)
def test_duplicate_ratings_are_refused_naming_both_lines(tmp_path, name):
    """A (user, item) pair twice in one file is refused, not merged; the valid copy loads."""
    load_dataset(name, _write(tmp_path / "ok", name), tmp_path / "cache")
    target = DUPLICATED[name]

    def duplicate(rel, lines):  # a blank line, then line 1's pair again (another rating) as line 4
        if rel == target:
            pair = lines[0].split("::" if "::" in lines[0] else "\t")[:2]
            sep = "::" if "::" in lines[0] else "\t"
            lines[2:2] = ["", sep.join([*pair, "1", "0"][: len(lines[0].split(sep))])]
        return lines

    root = _write(tmp_path / "dup", name, duplicate)
    user, item = SPLIT[name][target][0].split("::" if name == "ml-1m" else "\t")[:2]
    with pytest.raises(DataError, match="^" + re.escape(f"{root / target}:4: user {user} and item {item} again "
                                                        "(first on line 1); expected each (user, item) pair once")):
        load_dataset(name, root, tmp_path / "cache")


@pytest.mark.parametrize("name, test_file",
                         [("ml-100k", "ml-100k/u1.test"), ("disencdr:a_b", "disencdr_amazon/a_b/test.txt")])
def test_a_test_rating_also_in_the_training_file_is_refused(tmp_path, name, test_file):
    def leak(rel, lines):
        return [*lines, SPLIT[name][rel.replace("u1.test", "u1.base").replace("test.txt", "train.txt")][1]] \
            if rel == test_file else lines

    root = _write(tmp_path, name, leak)
    train_file = test_file.replace("u1.test", "u1.base").replace("test.txt", "train.txt")
    line = len(SPLIT[name][test_file]) + 1
    with pytest.raises(DataError, match="^" + re.escape(f"{root / test_file}:{line}: ")
                                        + r".* are also in the training "
                       + re.escape(f"file ({root / train_file}:2); expected disjoint train and test splits")):
        load_dataset(name, root, tmp_path / "cache")


def test_data_errors_through_the_cli_are_one_line(tmp_path, capsys):
    _write(tmp_path / "data", "ml-100k", lambda rel, lines: [*lines, lines[0]] if rel.endswith("u1.base") else lines)
    line = fails(["run", "--in-process", "--dataset", "ml-100k", "--data-dir", str(tmp_path / "data"),
                  "--cache-dir", str(tmp_path / "cache")], capsys)
    assert line.startswith(f"error: {tmp_path / 'data' / 'ml-100k' / 'u1.base'}:5: user 1 and item 1 again")
    line = fails(["run", "--in-process", "--dataset", "ml-100k", "--data-dir", str(tmp_path / "none"),
                  "--cache-dir", str(tmp_path / "cache")], capsys)  # the multi-line list of missing files, joined
    assert line.startswith("error: dataset 'ml-100k' is missing 2 file(s): put ml-100k/u1.base at ") and "; put" in line
    (tmp_path / "afile").write_text("")
    line = fails(["baselines", "--dataset", "ml-100k", "--data-dir", str(tmp_path / "afile")], capsys)
    assert line == f"error: data folder {tmp_path / 'afile'}: not a directory; expected the folder holding the " \
                   "datasets (--data-dir or data.data_dir, docs/datasets.md)"


# -- cache and output folders ---------------------------------------------------------------------------------

def _synthetic(tmp_path, cache: Path):
    return load_config("fedgnn_paper", "synthetic", [f"data.cache_dir={cache}", *TINY]).data


def test_a_cache_folder_that_is_a_file_is_named(tmp_path, capsys):
    (tmp_path / "cache").write_text("")
    with pytest.raises(FolderError, match="^" + re.escape(f"cache folder {tmp_path / 'cache' / 'partitions'}: not a "
                                                          f"directory ({tmp_path / 'cache'} is a file); "
                                                          f"expected a folder")):
        prepare_partitions(_synthetic(tmp_path, tmp_path / "cache"))
    line = fails(["run", "--in-process", "--cache-dir", str(tmp_path / "cache"), "--set", *TINY], capsys)
    assert line.startswith(f"error: cache folder {tmp_path / 'cache' / 'partitions'}: not a directory")


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fsutil.tempfile, "mkstemp", denied)
    with pytest.raises(FolderError, match=re.escape(f"cache folder {tmp_path / 'c' / 'partitions'}: not writable "
                                                    "(Permission denied); expected a folder this user can write")):
        prepare_partitions(_synthetic(tmp_path, tmp_path / "c"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_folder_is_named(tmp_path):
    (tmp_path / "c" / "partitions").mkdir(parents=True)
    (tmp_path / "c" / "partitions").chmod(0o500)
    try:
        with pytest.raises(FolderError, match="not writable"):
            prepare_partitions(_synthetic(tmp_path, tmp_path / "c"))
    finally:
        (tmp_path / "c" / "partitions").chmod(0o700)


def test_a_full_disk_fails_the_run_with_one_line_exit_1(tmp_path, monkeypatch, capsys):
    """Disk full while the cache is built: DiskFullError naming the cache folder, the build leaves nothing behind;
    through the CLI a run that fails (exit 1), not an input error."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(partition.np, "save", full)
    with pytest.raises(DiskFullError, match=re.escape(f"cache folder {tmp_path / 'c' / 'partitions'}: no space left on "
                                                      "the device while building the partitions of synthetic")):
        prepare_partitions(_synthetic(tmp_path, tmp_path / "c"))
    assert list((tmp_path / "c" / "partitions").iterdir()) == []
    line = fails(["run", "--in-process", "--cache-dir", str(tmp_path / "c"), "--set", *TINY], capsys, code=1)
    assert line.startswith(f"error: cache folder {tmp_path / 'c' / 'partitions'}: no space left on the device")


def test_results_json_on_a_full_disk_names_the_output_folder(tmp_path, monkeypatch):
    from fedrec_flwr.reporting.results import RunRecorder

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil.os, "replace", full)
    with pytest.raises(DiskFullError, match=re.escape(f"folder {tmp_path}: no space left on the device while writing "
                                                      "results.json")):
        RunRecorder(tmp_path, "fedgnn", "synthetic", {})
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left


def test_an_output_folder_that_is_a_file_is_named(tmp_path, capsys):
    (tmp_path / "out").write_text("")
    for how in ([], ["--centralized"]):
        line = fails([*tiny_run(tmp_path), *how], capsys)
        assert line == f"error: output folder {tmp_path / 'out'}: not a directory ({tmp_path / 'out'} is a file); " \
                       "expected a folder"


def _hold_lock(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s run lock until killed."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom fedrec_flwr.fsutil import folder_lock\n"
                             f"with folder_lock({str(folder)!r}):\n    print('held', flush=True)\n    "
                             f"time.sleep(120)\n"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_live_runs_output_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        line = fails(tiny_run(tmp_path), capsys)
        assert line == (f"error: output folder {out} is in use by another run (pid {holder.pid}, lock file "
                        f"{out / LOCK_FILE}); "
                        "expected a folder no running run writes: wait for it to end, or choose another folder")
        assert not (out / "results.json").exists()
    finally:
        holder.kill()
        holder.wait()
    with folder_lock(out) as lock:  # the dead holder's lock file is taken over
        assert lock.read_text().strip() == str(os.getpid())
        with pytest.raises(FolderError, match=f"in use by another run \\(pid {os.getpid()}"):
            with folder_lock(out):
                pass
    assert not (out / LOCK_FILE).exists()  # removed at exit


def test_a_stale_lock_file_of_a_dead_pid_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(dead.stdout)
    with folder_lock(tmp_path) as lock:
        assert lock.read_text().strip() == str(os.getpid())
    assert not lock.exists()


def test_a_run_that_fails_on_its_input_releases_its_output_folder(tmp_path, capsys):
    fails([*tiny_run(tmp_path), "data.name=ml-100k", f"data.data_dir={tmp_path / 'none'}"], capsys)
    assert (tmp_path / "out").is_dir() and not (tmp_path / "out" / LOCK_FILE).exists()


# -- node lists -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    (None, "no such file; expected a JSON object {node id: [user ids or domain index]}"),
    ("{oops", "not JSON (line 1, column 2: Expecting property name enclosed in double quotes)"),
    ("[1, 2]", "a JSON array; expected a JSON object"),
    ("{}", "lists no node"),
    ('{"abc": [1]}', "node id 'abc'; expected a decimal integer in [0, 2**64)"),
    ('{"12": [1], "12": [2]}', "node 12 is named twice"),
    ('{"12": 1}', "node 12 lists 1; expected a list of integer ids"),
    ('{"12": [true]}', "node 12 lists [true]; expected a list of integer ids"),
    ('{"12": [1.0]}', "node 12 lists [1.0]; expected a list of integer ids"),
    ('{"12": [1, 1]}', "node 12 lists id 1 twice"),
    ('{"12": [3]}', "node 12 lists id 3, outside [0, 3)"),
    ('{"12": [0], "13": [0]}', "id 0 is listed for nodes 12 and 13"),
])
def test_a_bad_node_list_names_the_file_and_what_was_expected(tmp_path, text, message):
    path = tmp_path / "nodes.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(NodeListError) as err:
        load_node_list(path, 3)
    assert str(err.value).startswith(f"deployment.node_list {path}: {message}") and "\n" not in str(err.value)


def test_a_bad_node_list_stops_fedrec_run_before_flower_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "stream_flwr_run", lambda *a, **k: pytest.fail("flwr run was started"))
    (tmp_path / "nodes.json").write_text('{"5": [12]}')  # the tiny dataset has users 0..11
    line = fails(tiny_run(tmp_path, f"deployment.node_list={tmp_path / 'nodes.json'}"), capsys)
    assert line == f"error: deployment.node_list {tmp_path / 'nodes.json'}: node 5 lists id 12, outside [0, 12)"


# -- checkpoints ----------------------------------------------------------------------------------------------

def _server_state(cfg, num_items: int = 40, num_users: int = 12) -> dict:
    from fedrec_flwr.fedgnn.server import FedGNNServer

    server = FedGNNServer.from_config(cfg, num_items, 3.0)
    return {**server.state(), "logical_round": 3, "train_rounds_done": 2, "rounds_not_applied": 0,
            "history": [{"round": 2, "phase": "train"}], "rejections": [[2, "node 5: refused"]],
            "uploads": [1] * num_users, "eval_rejected": 0, "config": to_dict(cfg)}


def _set(key: str, value):
    def spoil(state):
        parent = state
        *path, last = key.split("/")
        for part in path:
            parent = parent[part]
        parent[last] = value(parent.get(last)) if callable(value) else value
    return spoil


CORRUPT = {  # what is spoiled -> (how, the start of the message after the file name)
    "items 1-D": (_set("items", torch.zeros(40)),
                  "key 'items' = a float32 tensor of shape (40,); expected the item table"),
    "items width": (_set("items", torch.zeros(40, 9)),
                    "key 'items' = a float32 tensor of shape (40, 9); expected shape (40, 8)"),
    "items NaN": (_set("items", torch.full((40, 8), float("nan"))), "key 'items' holds NaN or infinite values"),
    "sparse model": (_set("model/bias", torch.zeros(3).to_sparse()), "key 'model.bias' = a torch.sparse_coo float32"),
    "model shape": (_set("model/encoder.conv.lin.weight", torch.zeros(4, 4)),
                    "key 'model.encoder.conv.lin.weight' = a float32 tensor of shape (4, 4); expected a floating-point "
                    "tensor of shape (8, 8) (the model of the checkpoint's own config)"),
    "model missing": (lambda s: s["model"].pop("bias"), "key 'model' has parameters"),
    "model NaN": (_set("model/bias", torch.tensor(float("inf"))), "key 'model.bias' holds NaN or infinite values"),
    "logical_round bool": (_set("logical_round", True), "key 'logical_round' = True; expected an integer >= 1"),
    "train_rounds_done": (_set("train_rounds_done", 9), "key 'train_rounds_done' = 9; expected an integer in [0, "
                                                          "logical_round = 3]"),
    "rounds_not_applied": (_set("rounds_not_applied", -1), "key 'rounds_not_applied' = -1; expected an integer in [0"),
    "eval_rejected": (_set("eval_rejected", "x"), "key 'eval_rejected' = 'x'; expected an integer >= 0"),
    "uploads": (_set("uploads", [1, -2]), "key 'uploads' = a list; expected a list of per-user upload counts"),
    "history": (_set("history", [3]), "key 'history' = a list; expected a list of round records"),
    "rejections": (_set("rejections", [[2]]), "key 'rejections' = a list; expected a list of [round, reason] pairs"),
    "torch_rng": (_set("torch_rng", torch.zeros(8, dtype=torch.uint8)),
                  "key 'torch_rng' = a uint8 tensor of shape (8,)"),
    "model_opt": (_set("model_opt", [1]), "key 'model_opt' = a list; expected an optimiser state dict"),
    "optimiser groups": (_set("model_opt/param_groups", lambda g: [{**g[0], "params": [0, 1]}]),
                         "key 'model_opt.param_groups' names parameters [0, 1]; expected each of the 5 parameters"),
    "optimiser buffer": (_set("model_opt/state", {4: {"momentum_buffer": torch.zeros(8, 9)}}),
                         "key 'model_opt.state[4].momentum_buffer' = a float32 tensor of shape (8, 9); expected a "
                         "dense tensor of shape (8, 8)"),
    "popularity": (_set("popularity", torch.zeros(39)), "key 'popularity' = a float32 tensor of shape (39,); expected "
                                                         "shape (40,)"),
    "config": (_set("config", [1]), "key 'config' = a list; expected the run's config"),
    "config model": (_set("config/model/gnn", "transformer"), "key 'config.model' = "),
    "huge config": (_set("config/model/dim", 10**6), "key 'model' holds "),
}


def test_a_checkpoint_written_by_the_app_loads_with_every_check(tmp_path):
    cfg = load_config("fedgnn_paper", "synthetic", ["model.dim=8"])
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_server_state(cfg))
    assert ckpt.load()["logical_round"] == 3
    assert ckpt.load(expect=StateShapes.of(to_dict(cfg), 40, 12))["uploads"] == [1] * 12


@pytest.mark.parametrize("damage", CORRUPT)
def test_every_checkpoint_field_is_type_and_shape_checked(tmp_path, damage):
    cfg = load_config("fedgnn_paper", "synthetic", ["model.dim=8"])
    state = _server_state(cfg)
    spoil, message = CORRUPT[damage]
    spoil(state)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state)
    t0 = time.time()
    with pytest.raises(CheckpointError) as err:
        ckpt.load()
    assert str(err.value).startswith(f"{ckpt.path}: {message}"), str(err.value)
    assert "\n" not in str(err.value) and time.time() - t0 < 30  # a crafted config allocates nothing large


def test_a_checkpoint_is_checked_against_the_runs_dataset_sizes(tmp_path):
    cfg = load_config("fedgnn_paper", "synthetic", ["model.dim=8"])
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_server_state(cfg))
    with pytest.raises(CheckpointError, match=re.escape("key 'items' = a float32 tensor of shape (40, 8); expected "
                                                        "shape (41, 8): one row per item")):
        ckpt.load(expect=StateShapes.of(to_dict(cfg), 41, 12))
    with pytest.raises(CheckpointError,
                       match=re.escape("key 'uploads' holds the upload counts of 12 users; expected 13")):
        ckpt.load(expect=StateShapes.of(to_dict(cfg), 40, 13))
    with pytest.raises(CheckpointError, match=re.escape("key 'model.encoder.conv.att_src' = a float32 tensor of shape "
                                                        "(1, 1, 8); expected a floating-point tensor of shape (1, 1, "
                                                        "16) (the model of the run's config)")):
        ckpt.load(expect=StateShapes.of(to_dict(load_config("fedgnn_paper", "synthetic", ["model.dim=16"])), 40, 12))


def _resumed(tmp_path) -> tuple[RunRequest, Path, object]:
    """A tiny resumed FedGNN request, its output folder and the config its ServerApp would build."""
    request = RunRequest("fedgnn_paper", "synthetic", 0, str(tmp_path / "data"), str(tmp_path / "cache"),
                         (*TINY, "checkpoint.resume=true"))
    out = tmp_path / "out"
    return request, out, from_run_config(runner._run_config(request, out))


def test_fedrec_run_checks_a_resumed_runs_checkpoint_before_flower_starts(tmp_path, capsys, monkeypatch):
    """Against the run's config and dataset (the ServerApp's own comparison included): a failed run, exit 1,
    the reason its last words and recorded in results.json."""
    monkeypatch.setattr(runner, "stream_flwr_run", lambda *a, **k: pytest.fail("flwr run was started"))
    request, out, cfg = _resumed(tmp_path)
    meta = partition.UserPartitions(prepare_partitions(cfg.data)).meta
    ckpt = Checkpointer(out / "checkpoint")
    state = _server_state(cfg, meta.num_items, meta.num_users)
    ckpt.save(state)
    runner._preflight(cfg, 12)  # a checkpoint of this run passes
    other = to_dict(cfg)
    other["federation"] = {**other["federation"], "rounds": 7}
    cases = [
        (dict(state, items=torch.zeros(meta.num_items + 1, 8)), f"key 'items' = a float32 tensor of shape "
         f"({meta.num_items + 1}, 8); expected shape ({meta.num_items}, 8): one row per item of width 8 "
         f"(this run's config"),
        (dict(state, uploads=[0] * (meta.num_users + 1)), f"key 'uploads' holds the upload counts of "
         f"{meta.num_users + 1} users; expected {meta.num_users}"),
        (dict(state, config=other), f"checkpoint {ckpt.folder} was written with a different config (sections "
                                    f"['federation'])"),
    ]
    for spoiled, message in cases:
        ckpt.save(spoiled)
        with pytest.raises(SystemExit) as stop:
            cli_main([*tiny_run(tmp_path), "checkpoint.resume=true", "--data-dir", request.data_dir])
        assert str(stop.value).startswith("federated run failed (before flwr run): CheckpointError: ")
        assert message in str(stop.value) and "\n" not in str(stop.value)
        assert read_results(out)["status"] == "failed" and message in read_results(out)["error"]
    ckpt.path.unlink()
    with pytest.raises(SystemExit, match="federated run failed .*no checkpoint at"):
        cli_main([*tiny_run(tmp_path), "checkpoint.resume=true", "--data-dir", request.data_dir])


def test_an_in_process_run_told_to_resume_without_a_checkpoint_fails_in_one_line(tmp_path):
    folder = tmp_path / "nothing-here"
    with pytest.raises(SystemExit) as stop:
        cli_main([*tiny_run(tmp_path), "checkpoint.resume=true", f"checkpoint.dir={folder}", "--data-dir",
                  str(tmp_path / "data"), "--in-process"])
    assert str(stop.value) == (f"run failed: CheckpointError: checkpoint.resume is set but there is no checkpoint at "
                               f"{folder / 'server.pt'}")


# -- results files for summary and plot -----------------------------------------------------------------------

GOOD_RESULTS = {"algorithm": "fedgnn", "dataset": "synthetic", "status": "finished", "wall_seconds": 1.0,
                "final": {"rmse": 0.9}, "rounds": [{"round": 2, "phase": "train", "rmse": 1.0, "round_seconds": 0.5}]}


@pytest.mark.parametrize("content, message", [
    (None, "no such file; expected the results.json a run writes in its output folder"),
    ("{", "not JSON (line 1, column 2: Expecting property name enclosed in double quotes)"),
    ("[]", "a JSON list; expected an object"),
    (json.dumps({**GOOD_RESULTS, "status": None}), "key 'status' = null; expected a string"),
    (json.dumps({k: v for k, v in GOOD_RESULTS.items() if k != "algorithm"}), "no key 'algorithm'"),
    (json.dumps({**GOOD_RESULTS, "status": "done"}), "key 'status' = \"done\"; expected one of"),
    (json.dumps({**GOOD_RESULTS, "rounds": {}}), "key 'rounds' = {}; expected a list of round records"),
    (json.dumps({**GOOD_RESULTS, "rounds": [{"round": 2, "rmse": "low"}]}),
     "key 'rounds[0].rmse' = \"low\"; expected a number"),
    (json.dumps({**GOOD_RESULTS, "rounds": [{"rmse": 1.0}]}),
     "key 'rounds[0].round' = null; expected the round's number"),
    (json.dumps({k: v for k, v in GOOD_RESULTS.items() if k != "wall_seconds"}), "key 'wall_seconds' = null"),
    (json.dumps({**GOOD_RESULTS, "final": {"eval_ratings": 2.5}}),
     "key 'final.eval_ratings' = 2.5; expected an integer"),
    (json.dumps({**GOOD_RESULTS, "baselines": {"bias": 1.0}}),
     "key 'baselines' = {\"bias\": 1.0}; expected the trivial"),
    (json.dumps({**GOOD_RESULTS, "privacy": {"delta": 1e-5}}),
     "key 'privacy' = {\"delta\": 1e-05}; expected the accounted"),
])
def test_a_bad_results_file_names_the_file_and_key(tmp_path, capsys, content, message):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "results.json").write_text(content)
    with pytest.raises(ResultsFileError) as err:
        read_results(run)
    assert str(err.value).startswith(f"{run / 'results.json'}: {message}"), str(err.value)
    for argv in (["summary", str(run)], ["plot", str(run)]):
        assert fails(argv, capsys).startswith(f"error: {run / 'results.json'}: {message}")


def test_summary_and_plot_name_a_missing_run_and_an_unusable_plot_folder(tmp_path, capsys):
    assert fails(["summary", str(tmp_path / "gone")], capsys) == (
        f"error: run {tmp_path / 'gone'}: no such folder or file; expected a run's output folder (holding "
        "results.json) or its results.json")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps(GOOD_RESULTS))
    cli_main(["summary", str(tmp_path / "run")])
    assert "rmse=0.9000" in capsys.readouterr().out
    (tmp_path / "plots").write_text("")
    assert fails(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "plots")], capsys) == (
        f"error: plot folder {tmp_path / 'plots'}: not a directory ({tmp_path / 'plots'} is a file); expected a folder")


# -- flwr run's tracebacks --------------------------------------------------------------------------------------

# the end of `flwr run --stream` when the ServerApp raised at its start (Flower 1.42, trimmed)
FLOWER_FAILURE = """\
Successfully started run 17286179372295741185
[fedrec_flwr.server] INFO dataset synthetic: 12 users, 40 items, 58 train / 2 test ratings; output /o
\x1b[91mERROR \x1b[0m:     Simulation raised an exception
Traceback (most recent call last):
  File "/v/flwr/simulation/app.py", line 337, in run_simulation_process
    simulation_result = _run_simulation(
                        ^^^^^^^^^^^^^^^^
  File "/a/fedrec_flwr/fedgnn/checkpoint.py", line 50, in load
    raise CheckpointError(f"checkpoint.resume is set but there is no checkpoint at {self.path}")
fedrec_flwr.fedgnn.checkpoint.CheckpointError: checkpoint.resume is set but there is no checkpoint at /o/server.pt
\x1b[91mERROR \x1b[0m:     Exit Code: 700

An unhandled exception occurred when running the simulation.
"""
CHAINED = """\
(ClientAppActor pid=77) Traceback (most recent call last):
(ClientAppActor pid=77)   File "x.py", line 1, in f
(ClientAppActor pid=77) KeyError: 'a'
(ClientAppActor pid=77)
(ClientAppActor pid=77) During handling of the above exception, another exception occurred:
(ClientAppActor pid=77)
(ClientAppActor pid=77) Traceback (most recent call last):
(ClientAppActor pid=77)   File "y.py", line 2, in g
(ClientAppActor pid=77) RuntimeError: injected crash
(ClientAppActor pid=77)     with a second line
INFO :      [ROUND 2]
"""

RAY_EMBEDDED = ("""\
[fedrec_flwr.fedgnn] WARNING round 2: rejected: client failure: <'\x1b[36mray::ClientAppActor.run()"""
                """\x1b[39m (pid=3443, ip=1)
                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/v/flwr/clientapp/client_app.py", line 144, in __call__
    return self._call(message, context)
clients.faults.InjectedCrash: injected crash (round 2)

The above exception was the direct cause of the following exception:

\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=3443, ip=1)
  File "/v/flwr/simulation/ray_transport/ray_actor.py", line 65, in run
    raise ClientAppException(str(ex)) from ex
flwr.clientapp.client_app.ClientAppException:{TRAILING_SPACE}
Exception ClientAppException occurred. Message: injected crash (round 2)'>)
[fedrec_flwr.fedgnn] WARNING round 2: 0 accepted updates < min_clients=2; model unchanged
""").format(TRAILING_SPACE=" ")  # Ray prints the exception's empty first message line with a trailing space


def _filtered(text: str) -> list[str]:
    tracebacks = TracebackFilter(lambda exc: f"<hidden {exc}>\n")
    out = [shown for line in text.splitlines(keepends=True) for shown in tracebacks.feed(line)]
    return "".join(out + tracebacks.close()).splitlines()


def test_tracebacks_in_flwr_runs_output_become_one_line():
    shown = _filtered(FLOWER_FAILURE)
    assert shown == [*FLOWER_FAILURE.splitlines()[:3],
                     "<hidden fedrec_flwr.fedgnn.checkpoint.CheckpointError: checkpoint.resume is set but there is no "
                     "checkpoint at /o/server.pt>", *FLOWER_FAILURE.splitlines()[-3:]]
    assert _filtered(CHAINED) == ["<hidden RuntimeError: injected crash>", "INFO :      [ROUND 2]"]
    assert _filtered("Traceback (most recent call last):\n  File \"z\"\n") == ["<hidden an exception>"]  # cut short
    lines = RAY_EMBEDDED.splitlines()  # Ray's remote traceback inside a log line's message, without its header
    assert _filtered(RAY_EMBEDDED) == [lines[0], "<hidden flwr.clientapp.client_app.ClientAppException:>", lines[-1]]
    assert _filtered("\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):\n  File \"f\", line "
                     "1\nOSError: x\n") \
        == ["\x1b[91mERROR \x1b[0m:     <hidden OSError: x>"]  # a traceback logged as a message keeps its log prefix


def test_the_driver_keeps_tracebacks_in_the_log_and_off_the_console(tmp_path, capsys):
    fake = tmp_path / "flwr"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({FLOWER_FAILURE!r})\n")
    fake.chmod(0o755)
    log = tmp_path / "flwr-run.log"
    assert stream_flwr_run([str(fake), "run"], dict(os.environ), log) == 0
    console = capsys.readouterr().out
    assert "Traceback" not in console and "File \"/a/fedrec_flwr" not in console
    assert f"(traceback of a CheckpointError hidden: the full output is in {log}; `fedrec --debug run ...` shows it)" \
        in console and "Exit Code: 700" in console
    assert log.read_text() == FLOWER_FAILURE  # the whole stream, tracebacks included
    stream_flwr_run([str(fake), "run"], dict(os.environ), log, debug=True)
    assert capsys.readouterr().out == FLOWER_FAILURE


FAKE_FAILING_FLWR = """#!{python}
import json, pathlib, re, sys
out = pathlib.Path(re.search(r"output-dir='([^']*)'", " ".join(sys.argv)).group(1))
(out / "results.json").write_text(json.dumps({{"algorithm": "fedgnn", "dataset": "synthetic", "status": "failed",
    "rounds": [], "error": "ValueError: no admin token\\n  File \\"quoted\\", line 1"}}))
sys.stdout.write({stream!r})
"""


def test_fedrec_run_ends_with_its_reason_as_one_line_and_keeps_tracebacks_in_the_log(tmp_path, monkeypatch, capsys):
    """`flwr run` (a stand-in) streams a ServerApp traceback and leaves a failed results.json whose reason
    spans lines: the console shows no traceback, the driver's reason is one line, the log holds everything."""
    fake = tmp_path / "flwr"
    fake.write_text(FAKE_FAILING_FLWR.format(python=sys.executable, stream=FLOWER_FAILURE))
    fake.chmod(0o755)
    monkeypatch.setattr(runner, "_flwr_binary", lambda: str(fake))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        cli_main(tiny_run(tmp_path))
    assert str(stop.value) == (f"federated run failed (flwr exit 0): ValueError: no admin token [...; the whole reason "
                               f"is in {out / 'results.json'}]")
    console = capsys.readouterr().out
    assert "Traceback" not in console and f"(traceback of a CheckpointError hidden: the full output is in " \
        f"{out / 'flwr-run.log'}" in console
    assert (out / "flwr-run.log").read_text() == FLOWER_FAILURE and not (out / LOCK_FILE).exists()
    with pytest.raises(SystemExit):
        cli_main(["--debug", *tiny_run(tmp_path)])
    assert "Traceback (most recent call last):" in capsys.readouterr().out  # --debug streams it


@needs_superlink
def test_a_failed_flwr_run_ends_with_the_drivers_reason_and_no_traceback(tmp_path):
    """The ServerApp raises at its start (a neighbour service named without its admin token): the console shows
    no traceback, its last line is the driver's reason, exit 1; the traceback is in <out>/flwr-run.log."""
    env = {k: v for k, v in os.environ.items() if k != "FEDREC_NB_ADMIN_TOKEN"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fedrec_flwr.cli.commands", *tiny_run(tmp_path),
                           "expansion.mode=fixed", "expansion.epoch=0", "expansion.service_address=127.0.0.1:9"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert lines[-1].startswith("federated run failed (flwr exit ") and "no admin token" in lines[-1], lines[-5:]
    assert "Traceback" not in proc.stdout and any("traceback of a ValueError hidden" in line for line in lines)
    assert "Traceback (most recent call last):" in (out / "flwr-run.log").read_text()
    assert read_results(out)["status"] == "failed" and not (out / LOCK_FILE).exists()
