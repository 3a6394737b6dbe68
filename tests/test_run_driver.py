"""fedrec run (fedrec_flwr.cli.runner): its wrapper around `flwr run` (output and exit code pass through, and a driver
that is killed stops its run on the SuperLink instead of leaving the simulation training), and its default
output folder when `--out` is not given."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import fedrec_flwr.cli.runner as run_driver
from fedrec_flwr.cli.commands import main as cli_main
from fedrec_flwr.cli.runner import default_out, stream_flwr_run

# Stands in for the flwr CLI: logs every call, and `run` prints what the real one prints, then
# either trains for a minute (FAKE_RUN_SECONDS) or exits with FAKE_RUN_EXIT.
FAKE_FLWR = """#!{python}
import os, pathlib, sys, time
here = pathlib.Path(sys.argv[0]).parent
with (here / "calls.log").open("a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1] == "run":
    print("Successfully started run 4242", flush=True)
    print("INFO :      [ROUND 1]", flush=True)
    (here / "started").touch()
    time.sleep(float(os.environ.get("FAKE_RUN_SECONDS", "0")))
    sys.exit(int(os.environ.get("FAKE_RUN_EXIT", "0")))
"""


@pytest.fixture
def fake_flwr(tmp_path):
    path = tmp_path / "flwr"
    path.write_text(FAKE_FLWR.format(python=sys.executable))
    path.chmod(0o755)
    return path


def calls(fake_flwr) -> list[str]:
    return (fake_flwr.parent / "calls.log").read_text().splitlines()


def test_output_and_exit_code_pass_through(fake_flwr, capsys):
    env = dict(os.environ, FAKE_RUN_EXIT="3")
    assert stream_flwr_run([str(fake_flwr), "run", ".", "local", "--stream"], env) == 3
    assert "Successfully started run 4242" in capsys.readouterr().out
    assert calls(fake_flwr) == ["run . local --stream"]


def test_sigterm_stops_the_run_on_the_superlink(fake_flwr):
    def kill_once_started():
        deadline = time.time() + 60
        while not (fake_flwr.parent / "started").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the driver reads the run id printed just before the marker
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    killer = threading.Thread(target=kill_once_started)
    killer.start()
    t0 = time.time()
    with pytest.raises(SystemExit) as stopped:
        stream_flwr_run([str(fake_flwr), "run", ".", "local", "--stream"], dict(os.environ, FAKE_RUN_SECONDS="60"))
    killer.join()
    assert stopped.value.code == 128 + signal.SIGTERM
    assert calls(fake_flwr) == ["run . local --stream", "stop 4242 local"]
    assert time.time() - t0 < 45  # `flwr run` itself was ended, not waited for
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_default_output_folder_names_preset_dataset_and_seed():
    assert default_out("fppdm", "amazon-phone-elec", 0) == Path("outputs/fppdm-amazon-phone-elec-s0")
    assert default_out("fppdm_pp", "disencdr:phone_elec", 2) == Path("outputs/fppdm_pp-disencdr-phone_elec-s2")
    assert default_out("fedgnn_paper", "a/../b c", 1) == Path("outputs/fedgnn_paper-a-..-b-c-s1")
    assert default_out("fedgnn_paper", "ml-100k", 0,
                       centralized=True) == Path("outputs/fedgnn_paper-ml-100k-s0-centralized")


@pytest.mark.parametrize("argv, expected", [
    (["--preset", "fppdm", "--dataset", "amazon-phone-elec", "--data-dir", "DATA"],
     "outputs/fppdm-amazon-phone-elec-s0"),
    (["--preset", "fppdm", "--dataset", "disencdr:phone_elec", "--seed", "3"], "outputs/fppdm-disencdr-phone_elec-s3"),
    (["--preset", "quickstart"], "outputs/quickstart-synthetic-s0"),  # the preset's own dataset
    (["--preset", "quickstart", "--out", "elsewhere/run"], "elsewhere/run"),
])
def test_out_is_optional_and_defaults_per_preset_dataset_and_seed(monkeypatch, capsys, argv, expected):
    seen = []

    def fake_run_federated(request, out):
        seen.append(out)
        return {"final": {"rmse": 1.0}}

    monkeypatch.setattr(run_driver, "run_federated", fake_run_federated)
    monkeypatch.setattr("fedrec_flwr.reporting.summary.summarize", lambda out: "summary")
    cli_main(["run", *argv])
    assert seen == [Path(expected)]
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"rmse": 1.0}  # the last line stays the metrics


def test_the_staged_app_builds_the_same_fab_without_entering_ignored_folders(tmp_path):
    """`flwr run` gets a copy of the app's own files; Flower's FAB of it equals the FAB of the project itself."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    from fedrec_flwr.flower.app_source import app_files, staged_app

    project = tmp_path / "project"
    for rel, text in {"pyproject.toml": (run_driver.ROOT / "pyproject.toml").read_text(),
                      ".gitignore": ".venv/\noutputs/\n*.pyc\n", "fedrec_flwr/app.py": "x = 1\n",
                      "conf/a.yaml": "k: 1\n", ".venv/lib/site.py": "y = 2\n", "outputs/latest/results.json": "{}",
                      "fedrec_flwr/app.pyc": "", "README.md": "# r\n"}.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    assert sorted(app_files(project)) == [".gitignore", "README.md", "conf/a.yaml", "fedrec_flwr/app.py",
                                          "pyproject.toml"]
    with staged_app(project, tmp_path / "cache") as app:
        staged = build_fab_from_disk(app)
        assert sorted(p.relative_to(app).as_posix() for p in app.rglob("*")
                      if p.is_file()) == sorted(app_files(project))
    assert not any((tmp_path / "cache").iterdir())  # removed after the run
    assert staged == build_fab_from_disk(project)
    assert "fedrec_flwr/app.py" in zipfile.ZipFile(io.BytesIO(staged)).namelist()
