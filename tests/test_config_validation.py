"""Config trust boundary: every numeric key finite and in range, list overrides, errors that name the key."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedrec_flwr.cli.commands import main as cli_main
from fedrec_flwr.config import (
    AppConfig,
    ConfigError,
    from_run_config,
    load_config,
    numeric_keys,
    parse_overrides,
)

ROOT = Path(__file__).resolve().parent.parent


def run_main(argv: list[str]) -> None:
    """`fedrec run ARGV`."""
    cli_main(["run", *argv])


def _default(key: str):
    value = AppConfig()
    for part in key.split("."):
        value = getattr(value, part)
    return value


RANGES = numeric_keys()  # key -> the range declared beside its field
FLOAT_KEYS = [k for k in RANGES if isinstance(_default(k), float)]


def _outside(key: str) -> list[str]:
    """Values just outside the key's range, written as an override would be."""
    rule, default = RANGES[key], _default(key)
    kind = type(default[0]) if isinstance(default, list) else type(default)
    bad = []
    if rule.low is not None:
        bad.append(rule.low if rule.open_low else rule.low - 1)
    if rule.high is not None:
        bad.append(rule.high if rule.open_high else rule.high + 1)
    text = [str(kind(v)) if kind is int else repr(float(v)) for v in bad]
    return [f"[{t}]" for t in text] if isinstance(default, list) else text


def test_every_numeric_key_declares_its_range_beside_its_field():
    assert {"seed", "data.synthetic.degree_exponent", "fppdm.evaluation.topk",
            "deployment.node_wait_seconds"} <= set(RANGES)
    assert sorted(k for k, rule in RANGES.items() if rule is None) == [], "numeric config fields without ranged(...)"


CONF = ROOT / "conf"
PRESETS = sorted(path.stem for path in CONF.glob("*.yaml"))  # every preset file, as `--preset` names them
# a preset's per-dataset settings: conf/<preset>/<dataset>.yaml
PRESET_DATASETS = sorted((folder.name, path.stem) for folder in CONF.iterdir()
                         if (CONF / f"{folder.name}.yaml").is_file()
                         for path in folder.glob("*.yaml"))


def _out_of_range(cfg: AppConfig) -> list[str]:
    """Every numeric key of `cfg` whose value (or any element of a list) is not finite or lies outside the range
    declared beside its field, compared here bound by bound."""
    bad = []
    for key, rule in RANGES.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        for v in value if isinstance(value, list) else [value]:
            low_ok = rule.low is None or (v > rule.low if rule.open_low else v >= rule.low)
            high_ok = rule.high is None or (v < rule.high if rule.open_high else v <= rule.high)
            if not (math.isfinite(v) and low_ok and high_ok):
                bad.append(f"{key} = {value!r} ({rule.describe()})")
    return bad


def test_the_dataclass_defaults_are_in_range():
    assert RANGES and _out_of_range(AppConfig()) == []


def test_the_preset_list_is_read_from_conf():
    """Guards the parametrisations below against an empty or partial listing."""
    assert {"quickstart", "fedgnn_paper", "fedgnn_user_dp", "fppdm", "trivial"} <= set(PRESETS) and len(PRESETS) >= 10
    assert ("fedgnn_tuned", "douban") in PRESET_DATASETS and all(p in PRESETS for p, _ in PRESET_DATASETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_with_every_numeric_key_in_range(preset):
    cfg = load_config(preset)
    assert cfg.preset == preset and _out_of_range(cfg) == []


@pytest.mark.parametrize("preset, dataset", PRESET_DATASETS)
def test_every_presets_dataset_settings_load_with_every_numeric_key_in_range(preset, dataset):
    cfg = load_config(preset, dataset)
    assert cfg.preset == preset and cfg.data.name == dataset and _out_of_range(cfg) == []


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_nan_and_infinity_are_refused_for_every_float_key(key):
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError, match=re.escape(f"config key '{key}' = ") + r".*expected a finite number"):
            load_config("fedgnn_paper", "synthetic", [f"{key}={value}"])


@pytest.mark.parametrize("key", sorted(k for k, r in RANGES.items() if r.low is not None or r.high is not None))
def test_every_bounded_key_refuses_a_value_outside_its_range(key):
    for value in _outside(key):
        with pytest.raises(ConfigError, match=re.escape(f"config key '{key}' = ")):
            load_config("fedgnn_paper", "synthetic", [f"{key}={value}"])


@pytest.mark.parametrize("override, message", [
    ("federation.min_clients=0", "'federation.min_clients' = 0; expected >= 1"),
    ("federation.min_clients=129", "'federation.min_clients' = 129; expected <= federation.clients_per_round (128)"),
    ("expansion.retries=-1", "'expansion.retries' = -1; expected >= 0"),
    ("server_opt.momentum=1.0", "'server_opt.momentum' = 1.0; expected 0 <= momentum < 1"),
    ("local.user_lr=0", "'local.user_lr' = 0.0; expected > 0"),
    ("centralized.lr=-0.1", "'centralized.lr' = -0.1; expected > 0"),
    ("data.synthetic.degree_exponent=1.0", "'data.synthetic.degree_exponent' = 1.0; expected > 1"),
    ("data.synthetic.test_fraction=1.0", "'data.synthetic.test_fraction' = 1.0; expected 0 <= fraction < 1"),
    ("fppdm.secure.key_bits=511", "'fppdm.secure.key_bits' = 511; expected >= 512"),
    ("fppdm.evaluation.topk=[]", "'fppdm.evaluation.topk' = []; expected a non-empty list"),
    ("fppdm.evaluation.topk=[5,0]", "'fppdm.evaluation.topk' = [5, 0]; expected every element >= 1"),
    ("deployment.node_wait_seconds=-1", "'deployment.node_wait_seconds' = -1.0; expected >= 0"),
])
def test_range_errors_name_the_key_and_the_range(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("fedgnn_paper", "synthetic", [override])


def test_expansion_right_after_registration_stays_allowed():
    assert load_config("fedgnn_paper", "synthetic", ["expansion.epoch=0"]).expansion.epoch == 0


def test_list_values_survive_override_parsing():
    assert parse_overrides("fppdm.evaluation.topk=[5,10] federation.rounds=2") == [
        "fppdm.evaluation.topk=[5,10]", "federation.rounds=2"]
    assert parse_overrides("fppdm.evaluation.topk=[5, 10]") == ["fppdm.evaluation.topk=[5,10]"]
    assert parse_overrides("a=1,b=2") == ["a=1", "b=2"]  # comma-separated items still split
    assert parse_overrides("x='a, b' y=2") == ["x=a, b", "y=2"]
    assert load_config("fppdm", None, ["fppdm.evaluation.topk=[1,20]"]).fppdm.evaluation.topk == [1, 20]
    cfg = from_run_config({"preset": "fppdm", "set": "fppdm.evaluation.topk=[3, 7] federation.rounds=2"})
    assert cfg.fppdm.evaluation.topk == [3, 7] and cfg.federation.rounds == 2


@pytest.mark.parametrize("run_config, message", [
    ({"seed": "abc"}, "run-config key 'seed' = 'abc'; expected an integer"),
    ({"seed": 1.5}, "run-config key 'seed' = 1.5; expected an integer"),
    ({"set": "federation.rounds='2"}, "run-config key 'set': "),
    ({"set": "federation.rounds"}, "run-config key 'set': override 'federation.rounds' is not of the form key=value"),
])
def test_run_config_errors_name_the_run_config_key(run_config, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_run_config({"preset": "fedgnn_paper", **run_config})
    assert from_run_config({"preset": "fedgnn_paper", "seed": "7"}).seed == 7


@pytest.mark.parametrize("override, key", [
    ("model.colour=3", "model.colour"), ("federation.rounds=many", "federation.rounds"),
    ("fppdm.evaluation.topk=[a]", "fppdm.evaluation.topk"), ("local.user_lr=nan", "local.user_lr"),
])
def test_each_error_is_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("fedgnn_paper", "synthetic", [override])
    assert key in str(err.value) and "\n" not in str(err.value)


def test_the_cli_prints_a_config_error_as_one_line_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedrec_flwr.cli.commands", "run", "--out", str(tmp_path / "o"),
                           "--set", "federation.rounds=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: config key 'federation.rounds' = 0; expected >= 1"]


def test_every_run_mode_exits_2_on_config_errors(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as stopped:
        run_main(["--out", str(tmp_path / "o"), "--centralized", "--set", "centralized.lr=inf"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: config key 'centralized.lr' = inf; expected a finite number (not NaN or infinity)"]
    with pytest.raises(SystemExit) as stopped:
        run_main(["--in-process", "--set", "fppdm.secure.key_bits=64"])
    assert stopped.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: config key 'fppdm.secure.key_bits' = 64; expected >= 512"]
