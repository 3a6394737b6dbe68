"""Every FedGNN registry dataset has its `fedgnn_tuned` settings, and its command runs end to end.

For each of ml-100k, douban, flixster, yahoo_music, ml-1m and ml-10m: a tiny fixture in that dataset's
file format goes where the registry looks for it (under the data dir; existing files are read without
a checksum, which is checked only on download), the preset + dataset file resolve to the dataset's
own settings, and the run of `fedrec run --preset fedgnn_tuned --dataset <name>`, cut to 2 training
rounds, ends with a finite RMSE on the dataset's scale. Flixster goes through the driver itself
(`fedrec_flwr.cli.commands.main`), whose `flwr run` is answered by the app's own ServerApp and ClientApp entry
points in this process; the real `flwr run` transport through the same driver is tests/test_e2e_flwr.py's.
The rest go through the same server and clients in one process (tests/inprocess.py).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from flwr.app import RecordDict
from flwr.common import Context, EvaluateIns, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.config import flatten_dict, fuse_dicts, get_project_config, parse_config_args
from inprocess import drive
from test_data import write_mat_v73

from clients.fedgnn import FedGNNClient
from clients.user_store import NodeStateStore
from fedrec_flwr.algorithms import get_algorithm
from fedrec_flwr.config import CONF_DIR, load_config, to_dict
from fedrec_flwr.data import UserPartitions, load_from_config, prepare_partitions
from fedrec_flwr.data.sources import get_spec
from fedrec_flwr.flower.client_app import client_fn, users_of
from fedrec_flwr.flower.federation_size import auto_nodes
from fedrec_flwr.flower.server_app import fedgnn_components, server_fn
from tests.conftest import TEST_SECRET

# public facts of each dataset (README "Datasets"): users, items, and the most ratings one user has
# in training (ML-100K u1.base: 685, Douban: 108, as conf/fedgnn_tuned.yaml notes; ML-1M: 2,314 and
# ML-10M: 7,359 in all; Flixster and Yahoo: bounded here by their item count)
SIZES = {
    "ml-100k": (943, 1682, 685),
    "douban": (3000, 3000, 108),
    "flixster": (3000, 3000, 3000),
    "yahoo_music": (3000, 3000, 3000),
    "ml-1m": (6040, 3706, 2314),
    "ml-10m": (69878, 10677, 7359),
}
FEDGNN_DATASETS = list(SIZES)
FIXTURE_USERS, FIXTURE_ITEMS, PER_USER = 24, 30, 8
# every fixture also holds a cold user (test ratings only: raw id FIXTURE_USERS + 1) and a cold item (rated in
# the test split only: raw id FIXTURE_ITEMS + 1), which a run must score like any other test rating
COLD_USER, COLD_ITEM = FIXTURE_USERS + 1, FIXTURE_ITEMS + 1
ALL_USERS = FIXTURE_USERS + 1


def _ratings(scale, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PER_USER distinct items per user, ratings on the dataset's scale (1-based raw ids)."""
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(1, FIXTURE_USERS + 1), PER_USER)
    items = np.concatenate([rng.choice(FIXTURE_ITEMS, PER_USER, replace=False) + 1 for _ in range(FIXTURE_USERS)])
    steps = round((scale.high - scale.low) / scale.step)
    values = scale.low + scale.step * rng.integers(0, steps + 1, users.size)
    return users, items, values


def _write_split_files(root: Path, rels: list[str], scale) -> None:
    """ML-100K: u1.base / u1.test, `user \\t item \\t rating \\t timestamp`, the last 2 ratings of each user held
    out, and the cold user's and the cold item's ratings in u1.test."""
    users, items, values = _ratings(scale, 0)
    users = np.r_[users, COLD_USER, COLD_USER, 1]
    items = np.r_[items, 1, 2, COLD_ITEM]
    values = np.r_[values, scale.low, scale.high, scale.high]
    lines = [f"{u}\t{i}\t{v:g}\t881250949" for u, i, v in zip(users, items, values)]
    test = [k % PER_USER >= PER_USER - 2 or k >= FIXTURE_USERS * PER_USER for k in range(len(lines))]
    for rel, held in zip(rels, (False, True)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("".join(line + "\n" for line, t in zip(lines, test) if t == held))


def _write_mat(root: Path, rels: list[str], scale) -> None:
    """sRGCNN .mat (MATLAB v7.3): rating matrix M and disjoint 0/1 masks Otraining / Otest (the cold user's row
    and the cold item's column have Otest entries only)."""
    users, items, values = _ratings(scale, 1)
    m = np.zeros((ALL_USERS, COLD_ITEM))
    m[users - 1, items - 1] = values
    o_test = np.zeros_like(m)
    o_test[users[PER_USER - 1 :: PER_USER] - 1, items[PER_USER - 1 :: PER_USER] - 1] = 1
    m[COLD_USER - 1, :2] = m[0, COLD_ITEM - 1] = scale.high
    o_test[COLD_USER - 1, :2] = o_test[0, COLD_ITEM - 1] = 1
    o_train = (m != 0) & (o_test == 0)
    (root / rels[0]).parent.mkdir(parents=True, exist_ok=True)
    write_mat_v73(root / rels[0], {"M": m, "Otraining": o_train.astype(float), "Otest": o_test})


def _write_ratings_dat(root: Path, rels: list[str], scale) -> None:
    """MovieLens-1M/10M ratings.dat, `user::item::rating::timestamp` (the loader makes GC-MC's random split):
    two of the lines that split puts in the test set are the cold user's and the cold item's only ratings."""
    users, items, values = _ratings(scale, 2)
    n = users.size
    first_tests = np.random.RandomState(1234).permutation(n)[:2]  # load_ratings_dat's split: its first test lines
    users[first_tests], items[first_tests] = (COLD_USER, 1), (1, COLD_ITEM)
    (root / rels[0]).parent.mkdir(parents=True, exist_ok=True)
    (root / rels[0]).write_text("".join(f"{u}::{i}::{v:g}::978300760\n" for u, i, v in zip(users, items, values)))


WRITERS = {"ml-100k": _write_split_files, "douban": _write_mat, "flixster": _write_mat, "yahoo_music": _write_mat,
           "ml-1m": _write_ratings_dat, "ml-10m": _write_ratings_dat}


def write_fixture(name: str, data_dir: Path):
    """A tiny fixture of `name`'s file format at the registry's paths under `data_dir`; returns the scale."""
    spec = get_spec(name)
    WRITERS[name](data_dir, [f.relpath for f in spec.files], spec.scale)
    return spec.scale


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_fedgnn_dataset_resolves_to_its_own_settings():
    """Each dataset's conf/fedgnn_tuned/<name>.yaml applies to fedgnn_tuned and to fedgnn_features (which
    inherits it, even where it sets the key itself); ML-100K, which has no file, runs the preset's own values.
    Both keep popularity-proof sets."""
    for name in FEDGNN_DATASETS:
        path = CONF_DIR / "fedgnn_tuned" / f"{name}.yaml"
        tuned, private = load_config("fedgnn_tuned", name), load_config("fedgnn_features", name)
        assert tuned.data.name == private.data.name == name
        if name == "ml-100k":
            assert not path.exists()
            assert to_dict(tuned) == {**to_dict(load_config("fedgnn_tuned")), "data": to_dict(tuned)["data"]}
            continue
        settings = _leaves(yaml.safe_load(path.read_text()))
        assert settings, path
        for key, value in settings.items():
            assert _get(tuned, key) == value == _get(private, key), (name, key)
        assert tuned.privacy.pseudo_sampler == private.privacy.pseudo_sampler == "popularity"


def test_the_settings_follow_the_stated_reasoning():
    """What each file's comments promise: every rating in every upload, a rate that decays to 0.02-0.25 of its
    start over the schedule (ML-100K 0.03 and Douban 0.05, whose lengths were chosen on a validation holdout;
    about 0.13 on the others), each user sampled at least a few times, and at most about 1,000 SuperNodes."""
    for name, (users, items, most_ratings) in SIZES.items():
        cfg = load_config("fedgnn_tuned", name)
        assert cfg.local.batch_size >= min(most_ratings, items), name
        assert 0.02 <= cfg.server_opt.lr_decay ** cfg.federation.rounds <= 0.25, name
        assert cfg.federation.rounds * cfg.federation.clients_per_round / users >= 3, name
        nodes = auto_nodes(users, cfg.simulation) if cfg.simulation.users_per_node == 0 else \
            math.ceil(users / cfg.simulation.users_per_node)
        assert nodes <= 1000, name
        assert cfg.federation.rounds // cfg.federation.eval_every >= 10, name


def _two_round_config(name: str, tmp_path: Path, preset: str = "fedgnn_tuned"):
    data_dir = tmp_path / "data"
    scale = write_fixture(name, data_dir)
    cfg = load_config(preset, name, [f"data.data_dir={data_dir}", f"data.cache_dir={tmp_path / 'cache'}",
                                     f"output_dir={tmp_path / 'out'}", "federation.rounds=2"])
    return cfg, scale


def _check_every_test_rating_scored(doc: dict, cfg) -> None:
    """The fixture has a cold user and a cold item, and the run scored all its test ratings, the baselines
    beside it the same ones."""
    ds = load_from_config(cfg.data)
    tested, trained = set(ds.test.users.tolist()), set(ds.train.users.tolist())
    assert tested - trained and set(ds.test.items.tolist()) - set(ds.train.items.tolist()), "no cold user or item"
    final = doc["final"]
    assert final["eval_ratings"] == final["test_ratings"] == doc["baseline_ratings"] == len(ds.test)


def _check_final(doc: dict, name: str, scale, settings: dict) -> None:
    assert doc["status"] == "finished" and doc["dataset"] == name
    rmse = doc["final"]["rmse"]
    assert math.isfinite(rmse) and 0 < rmse <= scale.span, (name, rmse)
    assert [r.get("phase") for r in doc["rounds"]].count("train") == 2
    for key, value in settings.items():  # the run was configured by the dataset's own file
        got = doc["config"]
        for part in key.split("."):
            got = got[part]
        if key != "federation.rounds":
            assert got == value, (name, key)


def _settings(name: str) -> dict:
    path = CONF_DIR / "fedgnn_tuned" / f"{name}.yaml"
    return _leaves(yaml.safe_load(path.read_text())) if path.exists() else {}


@pytest.mark.parametrize("name", ["ml-100k", "douban", "yahoo_music", "ml-1m", "ml-10m"])
def test_a_two_round_fedgnn_tuned_run_on_a_fixture_of_each_dataset(name, tmp_path):
    """The server and clients of `flwr run` in one process: the nodes `fedrec run` starts (one per core: the preset's
    users_per_node is 0, auto), each hosting its share of the users."""
    cfg, scale = _two_round_config(name, tmp_path)
    num_nodes = get_algorithm(cfg.algorithm).part("nodes")(cfg)
    strategy = fedgnn_components(cfg).strategy
    parts = UserPartitions(prepare_partitions(cfg.data))
    per_node = cfg.simulation.users_per_node
    clients = {1000 + p: FedGNNClient(cfg, parts.meta, users_of({"partition-id": p, "num-partitions": num_nodes},
                                                               per_node, parts.meta.num_users),
                                      parts.user, NodeStateStore(RecordDict()), secret=TEST_SECRET)
               for p in range(num_nodes)}
    assert per_node == 0 and num_nodes == auto_nodes(ALL_USERS, cfg.simulation)
    drive(strategy, clients)
    doc = json.loads((Path(cfg.output_dir) / "results.json").read_text())
    _check_final(doc, name, scale, _settings(name))
    _check_every_test_rating_scored(doc, cfg)


def _in_process_flwr_run(cmd: list[str], env, log_path=None, debug=False) -> int:
    """Stands in for `flwr run` (fedrec_flwr.cli.runner.stream_flwr_run): the run config and SuperNode count the driver
    passed, fused with pyproject's defaults as Flower does, into the app's own ServerApp and ClientApp entry
    points (server_fn, client_fn), driven in this process (no output to log or filter). Returns the exit code 0."""
    class AsNumPy:
        """A flwr Client (what client_fn returns) behind the NumPyClient calls that inprocess.drive makes."""

        def __init__(self, client):
            self.client = client

        def fit(self, arrays, config):
            res = self.client.fit(FitIns(ndarrays_to_parameters(arrays), config))
            return parameters_to_ndarrays(res.parameters), res.num_examples, res.metrics

        def evaluate(self, arrays, config):
            res = self.client.evaluate(EvaluateIns(ndarrays_to_parameters(arrays), config))
            return res.loss, res.num_examples, res.metrics

    args = cmd[cmd.index("run") + 1:]
    project = Path(__file__).resolve().parents[1]  # flwr run gets a staged copy of the app's own files
    assert args[1:3] == ["local", "--stream"] and Path(args[0]) != project, cmd
    assert (Path(args[0]) / "pyproject.toml").read_bytes() == (project / "pyproject.toml").read_bytes(), cmd
    defaults = flatten_dict(get_project_config(args[0])["tool"]["flwr"]["app"].get("config"))
    run_config = fuse_dicts(defaults, parse_config_args([args[args.index("--run-config") + 1]]))
    nodes = parse_config_args([args[args.index("--federation-config") + 1]])["num-supernodes"]
    components = server_fn(Context(1, 0, {}, RecordDict(), run_config))
    clients = {7 + 13 * p: AsNumPy(client_fn(Context(1, 7 + 13 * p, {"partition-id": p, "num-partitions": nodes},
                                                     RecordDict(), run_config))) for p in range(nodes)}
    drive(components.strategy, clients, last_round=components.config.num_rounds)
    return 0


def test_flixster_through_the_benchmark_driver(tmp_path, capsys, monkeypatch):
    """`fedrec run --preset fedgnn_tuned --dataset flixster --data-dir DATA`, cut to 2 rounds: the driver's own
    config, node count and run config, answered by the app's ServerApp and ClientApp entry points in this process
    (`_in_process_flwr_run`). Flower's own transport under the same driver: tests/test_e2e_flwr.py."""
    import fedrec_flwr.cli.runner as run_driver
    from fedrec_flwr.cli.commands import main as cli_main

    monkeypatch.setattr(run_driver, "stream_flwr_run", _in_process_flwr_run)
    scale = write_fixture("flixster", tmp_path / "data")
    out = tmp_path / "out"
    cli_main(["run", "--preset", "fedgnn_tuned", "--dataset", "flixster", "--data-dir", str(tmp_path / "data"),
                     "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--set", "federation.rounds=2"])
    printed = capsys.readouterr().out.strip().splitlines()
    nodes = auto_nodes(25, load_config("fedgnn_tuned", "flixster").simulation)  # one per core, at most 25 users
    assert f"num-supernodes={nodes} " in next(line for line in printed if line.startswith("+ "))
    final = json.loads(printed[-1])
    doc = json.loads((out / "results.json").read_text())
    assert final["rmse"] == doc["final"]["rmse"]
    _check_final(doc, "flixster", scale, _settings("flixster"))
    _check_every_test_rating_scored(doc, load_config("fedgnn_tuned", "flixster",
                                                     [f"data.data_dir={tmp_path / 'data'}"]))
    phases = [r.get("phase") for r in doc["rounds"]]  # popularity-proof sets: a round of LDP item reports first
    assert phases[:2] == ["popularity", "register"] and doc["rounds"][1]["accepted"] == ALL_USERS


def test_the_default_sizing_starts_one_supernode_per_worker_and_no_more_than_the_users(monkeypatch):
    """users_per_node 0: one SuperNode per ClientApp the simulation runs at once (this machine's cores, or a Ray
    cluster's, over simulation.num_cpus), at most one per user."""
    sim = load_config("quickstart").simulation
    monkeypatch.setenv("FEDREC_CLUSTER_CPUS", "48")
    assert auto_nodes(10_000, sim) == 48 and auto_nodes(30, sim) == 30
    sim.num_cpus = 2.0
    assert auto_nodes(10_000, sim) == 24
    monkeypatch.delenv("FEDREC_CLUSTER_CPUS")
    assert auto_nodes(10_000, sim) == max(1, (os.cpu_count() or 1) // 2)
