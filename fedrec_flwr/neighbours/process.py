"""Start the neighbour service as its own process on loopback (what simulations do)."""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request

from .cli import ADMIN_TOKEN_ENV


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_local_service(timeout_s: float = 20.0,
                        extra_args: list[str] | None = None) -> tuple[str, subprocess.Popen, str]:
    """Spawn `python -m fedrec_flwr.neighbours.cli` on a free loopback port; stopped at exit, and stopping
    itself within a second or so when this process is gone (killed, so that no atexit ran).

    Draws a fresh admin token and hands it over in the environment (not argv, which `ps` shows);
    returns (address, process, admin token). `extra_args`: more service flags (limits).
    """
    port, token = _free_port(), secrets.token_hex(32)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedrec_flwr.neighbours.cli", "--host", "127.0.0.1", "--port", str(port),
         "--parent-pid", str(os.getpid()), *(extra_args or [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, ADMIN_TOKEN_ENV: token},
    )
    atexit.register(proc.terminate)
    address = f"127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"neighbour service exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://{address}/health", timeout=1) as resp:  # noqa: S310
                if resp.status == 200:
                    return address, proc, token
        except OSError:
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"neighbour service did not answer on {address} within {timeout_s:.0f}s")
