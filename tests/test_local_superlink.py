"""`make stop-superlink` stops this user's local SuperLink of this Flower home by process id, and no other
SuperLink on the machine (another Flower home's, standing in for another user's or run's)."""

from __future__ import annotations

import subprocess
import sys
import time

from fedrec_flwr.flower.local_superlink import local_superlink_pids, stop_local_superlink


def test_only_this_flower_homes_local_superlink_is_stopped(tmp_path, monkeypatch):
    ours_home, other_home = tmp_path / "ours", tmp_path / "other"
    monkeypatch.setenv("FLWR_HOME", str(ours_home))
    for home in (ours_home, other_home):
        home.mkdir()
    ours = subprocess.Popen([str(_script(tmp_path)), "--log-file",
                             str(ours_home / "local-superlink" / "superlink.log")])
    other = subprocess.Popen([str(_script(tmp_path)), "--log-file",
                              str(other_home / "local-superlink" / "superlink.log")])
    try:
        deadline = time.time() + 10
        while ours.pid not in local_superlink_pids() and time.time() < deadline:
            time.sleep(0.05)
        assert local_superlink_pids() == [ours.pid]
        assert stop_local_superlink() == [ours.pid]
        assert ours.wait(timeout=15) is not None
        assert other.poll() is None  # another home's SuperLink keeps running
    finally:
        for proc in (ours, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _script(folder):
    path = folder / "flower-superlink"
    path.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")  # its command line keeps the name
    path.chmod(0o755)
    return path
