"""Stop the local SuperLink that `flwr run . local` started for this user, and nothing else.

`flwr run` hands a simulation to a background SuperLink it starts once per Flower home (`$FLWR_HOME`, default
~/.flwr) and leaves running; it keeps the environment it was started with. Stopping every process named
flower-superlink would also end other users' SuperLinks and other Flower homes' runs on a shared machine. This
finds the processes by id instead: owned by this user, a `flower-superlink` whose log file is this Flower home's
local SuperLink log, and terminates those (then kills any that outlive a grace period).

    python -m fedrec_flwr.flower.local_superlink        # `make stop-superlink`
"""

from __future__ import annotations

import os
import sys

import psutil

GRACE_SECONDS = 10.0


def local_superlink_pids() -> list[int]:
    """Ids of this user's local SuperLink of this Flower home (`flwr run . local`'s managed one)."""
    from flwr.cli.local_superlink import _get_local_superlink_paths

    log_file = str(_get_local_superlink_paths()[1])
    pids = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        cmd, uids = proc.info.get("cmdline") or [], proc.info.get("uids")
        if uids is None or uids.real != os.getuid():
            continue
        named = any(os.path.basename(part) == "flower-superlink" for part in cmd[:2])
        if named and log_file in cmd:
            pids.append(proc.info["pid"])
    return pids


def stop_local_superlink() -> list[int]:
    """Terminate this user's local SuperLink of this Flower home (SIGTERM, then SIGKILL after GRACE_SECONDS);
    returns the ids it stopped."""
    procs = []
    for pid in local_superlink_pids():
        try:
            proc = psutil.Process(pid)
            proc.terminate()
            procs.append(proc)
        except psutil.NoSuchProcess:  # it ended on its own meanwhile
            continue
    _, alive = psutil.wait_procs(procs, timeout=GRACE_SECONDS)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def main() -> None:
    """Stop it and say which process ids were stopped."""
    stopped = stop_local_superlink()
    print(f"stopped local SuperLink (pid {', '.join(map(str, stopped))})" if stopped else "no local SuperLink running",
          file=sys.stderr)


if __name__ == "__main__":
    main()
