"""`fedrec`, the product's command line: config (resolved, and explained), run --in-process, baselines,
summary and plot; and the preset files it resolves hold only what differs from their base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedrec_flwr.cli.commands import main
from fedrec_flwr.config import CONF_DIR, AppConfig, available_presets, load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]


def _leaves(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}{key}."))
    return out


def _explained(capsys, *argv: str) -> dict[str, tuple[object, str]]:
    main(["config", "--explain", *argv])
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        key, rest = line.split(maxsplit=1)
        value, source = rest.rsplit("  (", 1)
        rows[key] = (json.loads(value), source.rstrip(")"))
    return rows


def test_config_explain_shows_every_non_default_value_of_quickstart_and_its_file(capsys):
    rows = _explained(capsys, "--preset", "quickstart")
    resolved, default = _leaves(to_dict(load_config("quickstart"))), _leaves(to_dict(AppConfig()))
    assert set(rows) == {k for k, v in resolved.items() if v != default[k]}
    for key, (value, source) in rows.items():
        assert value == resolved[key], key
        if source.startswith("conf/"):  # the file named really sets the key
            layer = yaml.safe_load((ROOT / source.split(",")[0]).read_text())
            assert key in _leaves(layer), (key, source)
    assert rows["model.dim"] == (32, "conf/quickstart.yaml")  # quickstart's own
    assert rows["model.gnn"] == ("ggnn", "conf/fedgnn_tuned.yaml")  # from its base
    assert rows["data.synthetic.num_users"][1] == "conf/datasets/synthetic.yaml"  # the dataset's file


def test_config_explain_names_overrides_and_the_dataset_option(capsys):
    rows = _explained(capsys, "--preset", "fedgnn_tuned", "--dataset", "douban", "--set", "model.dim=64")
    assert rows["model.dim"] == (64, "override model.dim=64")
    assert rows["data.name"] == ("douban", "--dataset")
    assert rows["federation.rounds"][1] == "conf/fedgnn_tuned/douban.yaml"


def test_config_prints_the_resolved_config(capsys):
    main(["config", "--preset", "fppdm_pp", "--set", "federation.rounds=3"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == to_dict(load_config("fppdm_pp", None, ["federation.rounds=3"]))
    assert printed["fppdm"]["coclustering"]["lambda_c"] == 0.07 and printed["algorithm"] == "fppdm"


@pytest.mark.parametrize("preset", available_presets())
def test_a_preset_file_holds_only_what_differs_from_its_base(preset):
    """Defaults are written once: every value a preset file sets changes what its base (or the defaults) gives."""
    layer = yaml.safe_load((CONF_DIR / f"{preset}.yaml").read_text()) or {}
    base = layer.pop("base", None)
    below = _leaves(to_dict(load_config(base) if base else AppConfig()))
    redundant = [k for k, v in _leaves(layer).items() if below.get(k) == v and k != "algorithm"]
    assert redundant == [], f"conf/{preset}.yaml repeats {redundant}"


def test_fppdm_pp_is_fppdm_with_co_clustering():
    pp, plain = to_dict(load_config("fppdm_pp")), to_dict(load_config("fppdm"))
    assert yaml.safe_load((CONF_DIR / "fppdm_pp.yaml").read_text())["base"] == "fppdm"
    assert {k for k, v in _leaves(pp).items() if _leaves(plain)[k] != v} == {"preset", "fppdm.coclustering.lambda_c"}


def test_run_in_process_writes_the_results_and_summary_a_flwr_run_writes(tmp_path, capsys):
    """`fedrec run --in-process`: results.json and rounds.csv in its output folder (the baselines on the same
    ratings), the summary, then the final metrics as its last line; `fedrec summary` reads the folder."""
    out = tmp_path / "out"
    main(["run", "--in-process", "--preset", "fedgnn_paper", "--dataset", "synthetic", "--out", str(out), "--set",
          f"data.cache_dir={tmp_path}", "data.synthetic.num_users=30", "data.synthetic.num_items=40",
          "data.synthetic.mean_degree=8", "model.dim=8", "privacy.pseudo_items=10", "federation.rounds=2",
          "federation.clients_per_round=8", "federation.eval_every=2"])
    printed = capsys.readouterr().out.strip().splitlines()
    final = json.loads(printed[-1])
    assert 0 < final["rmse"] < 4 and final["eval_ratings"] == final["test_ratings"] > 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "finished" and doc["final"]["rmse"] == final["rmse"]
    assert doc["baseline_ratings"] == final["test_ratings"] and (out / "rounds.csv").is_file()
    main(["summary", str(out)])
    summary = capsys.readouterr().out.strip()
    assert summary and summary in "\n".join(printed[:-1])  # the run printed what `fedrec summary` reads back


def test_an_in_process_run_that_trains_nothing_fails_with_the_reason(tmp_path):
    """Every upload refused (a NaN in each): no round applied, so no result (the CLI exits with this reason)."""
    import numpy as np

    from fedrec_flwr.cli.inprocess import run_in_process
    from fedrec_flwr.reporting.results import RunFailed

    cfg = load_config("fedgnn_paper", "synthetic", [
        f"data.cache_dir={tmp_path}", "data.synthetic.num_users=12", "data.synthetic.num_items=40", "model.dim=8",
        "privacy.pseudo_items=10", "federation.rounds=2", "federation.clients_per_round=4", "federation.eval_every=2"])

    def poisoned(user, rnd, upload):
        return [np.full_like(a, np.nan) if a.dtype.kind == "f" else a for a in upload]

    with pytest.raises(RunFailed, match="no training round was applied: all 2"):
        run_in_process(cfg, log_every=0, tamper=poisoned)


def test_baselines_summary_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["baselines", "--dataset", "synthetic"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| dataset | test ratings |") and table[2].startswith("| synthetic |")
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "algorithm": "fedgnn", "dataset": "synthetic", "status": "finished", "wall_seconds": 1.0,
        "final": {"rmse": 0.9, "eval_ratings": 10, "test_ratings": 10},
        "rounds": [{"round": 2, "phase": "train", "rmse": 1.0, "round_seconds": 0.5, "bytes_up": 1.0,
                    "bytes_down": 1.0},
                   {"round": 3, "phase": "train", "rmse": 0.9, "round_seconds": 0.5, "bytes_up": 1.0,
                    "bytes_down": 1.0}]}))
    main(["summary", str(run)])
    assert "test ratings scored: 10 of the split's 10" in capsys.readouterr().out
    main(["plot", str(run)])
    assert (run / "plots" / "rmse.png").is_file()


def test_a_benchmark_rerun_writes_a_fresh_file_unless_told_to_resume(tmp_path):
    """A documented benchmark command reruns every cell into a fresh file beside the committed record; only
    --resume continues (and rewrites) the named file."""
    from fedrec_flwr.cli.sweep import results_file

    committed = tmp_path / "fppdm_table.json"
    assert results_file(committed, resume=False) == committed  # nothing there yet: the named file
    committed.write_text("{}")
    fresh = results_file(committed, resume=False)
    assert fresh != committed and fresh.parent == committed.parent and fresh.name.startswith("fppdm_table-")
    fresh.write_text("{}")
    assert results_file(committed, resume=False) not in (committed, fresh)  # never an existing file
    assert results_file(committed, resume=True) == committed
