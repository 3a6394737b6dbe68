"""The neighbour service against strangers and greedy runs, and the device against a hostile service.

Strangers (no credential) are answered from the request head and never have a body read; per-address
limits keep one address from taking the slots others need; each run has its own storage budget;
the stored bytes are counted from what is kept and the process stays within its memory limit; a
device refuses replies that are not the run's [<= N, dim] table of finite numbers. Loopback only,
every wait bounded.
"""

from __future__ import annotations

import gc
import http.server
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from fedrec_flwr.neighbours import Limits, NeighbourClient, NeighbourService, NeighbourServiceError, RequestError, serve
from fedrec_flwr.neighbours import gate as gate_module
from fedrec_flwr.neighbours.cli import main as service_main
from fedrec_flwr.neighbours.process import start_local_service
from fedrec_flwr.neighbours.runs import RUN_FIXED_BYTES

ROOT = Path(__file__).resolve().parent.parent
ADMIN = "a" * 64
TOKEN = "1" * 32


def _serve(**limits):
    httpd, _ = serve("127.0.0.1", 0, admin_token=ADMIN, limits=Limits(**limits))
    return httpd, f"127.0.0.1:{httpd.server_address[1]}"


def _head(path: str, token: str | None = None, length: int = 100_000, extra: bytes = b"") -> bytes:
    auth = b"Authorization: Bearer %s\r\n" % token.encode() if token else b""
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s%s\r\n" % (path.encode(), length, auth, extra)


def _reply(sock: socket.socket, wait: float = 5.0) -> tuple[bytes, float]:
    """Everything the service sends until it closes the connection, and how long that took."""
    start, out = time.monotonic(), b""
    sock.settimeout(wait)
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out, time.monotonic() - start


def _status(reply: bytes) -> int | None:
    return int(reply.split()[1]) if reply.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")) else None


def _health(address: str) -> tuple[int, float]:
    host, port = address.split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply, _ = _reply(sock)
    return _status(reply), time.monotonic() - start


def _connect_as(address: str, ports: set[int]) -> socket.socket:
    """A connection whose source port is noted first (so a test can make it count as another address)."""
    host, port = address.split(":")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    ports.add(sock.getsockname()[1])
    sock.settimeout(5)
    sock.connect((host, int(port)))
    return sock


@pytest.fixture
def strangers_elsewhere(monkeypatch):
    """Connections from the noted source ports count as the address 'stranger', all others as themselves."""
    ports: set[int] = set()
    real = gate_module.address_key
    monkeypatch.setattr(gate_module, "address_key",
                        lambda peer: "stranger" if peer and peer[1] in ports else real(peer))
    return ports


# -- strangers ----------------------------------------------------------------------------------
def test_strangers_slow_bodies_do_not_block_honest_requests_or_health():
    # 40 strangers against 8 request slots: none may hold a slot while its body drips in
    httpd, address = _serve(max_inflight=8, io_timeout_s=5, idle_timeout_s=5)
    try:
        secret = NeighbourClient(address, retries=0, token=ADMIN).open_run("r", 2, 5, 3)
        host, port = address.split(":")
        heads = [_head("/runs/r/submit"), _head("/runs/r/submit", "f" * 64), _head("/runs", None),
                 _head("/runs", "b" * 64)]
        strangers = []
        for i in range(40):  # a request head and one byte of body each, then they hold
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(heads[i % 4] + b"{")
            strangers.append(sock)
        honest = NeighbourClient(address, retries=0, timeout_s=2, token=secret)
        start = time.monotonic()
        honest.submit("r", "a" * 32, np.zeros(2), [TOKEN])
        honest.submit("r", "b" * 32, np.ones(2), [TOKEN])
        assert honest.neighbours("r", "a" * 32).tolist() == [[1.0, 1.0]]
        assert _health(address)[0] == 200
        assert time.monotonic() - start < 1.0
        for i, sock in enumerate(strangers):
            reply, waited = _reply(sock)
            assert _status(reply) == (401 if i % 2 == 0 else 403), reply[:200]
            assert waited < 1.0  # closed at once: not after the 5 s body deadline
            sock.close()
    finally:
        httpd.shutdown()


def test_unauthenticated_bodies_are_refused_before_being_read():
    httpd, address = _serve(max_body_bytes=1 << 16, io_timeout_s=5, idle_timeout_s=5)
    try:
        secret = NeighbourClient(address, retries=0, token=ADMIN).open_run("r", 2, 5, 3)
        host, port = address.split(":")
        cases = [
            (_head("/runs/r/submit", length=10**9), 401),  # far over every size limit: the credential comes first
            (_head("/runs/r/submit", "f" * 64, length=10**9), 403),
            (_head("/runs/ghost/submit", secret), 404),
            (_head("/runs", length=10**9, extra=b"Expect: 100-continue\r\n"), 401),
            (_head("/runs/r/close", secret, length=10), 403),  # a run secret is no admin token
        ]
        for head, status in cases:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(head + b"{")
                reply, waited = _reply(sock)
            assert _status(reply) == status and b"100 Continue" not in reply, reply[:200]
            assert waited < 1.0 and json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert httpd.handlers.body_reads == 1  # only open_run's body was read
        with socket.create_connection((host, int(port)), timeout=5) as sock:  # the right secret: now it is read
            sock.sendall(_head("/runs/r/submit", secret, length=10**9))
            reply, _ = _reply(sock)
        assert _status(reply) == 413 and httpd.handlers.body_reads == 1  # too big for this run: refused from the head
        body = json.dumps({"handle": "c" * 32, "embedding": [1, 2], "tokens": [TOKEN]}).encode()
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(_head("/runs/r/submit", secret, length=len(body), extra=b"Expect: 100-continue\r\n"))
            assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")  # only an authenticated request is asked for it
            sock.sendall(body)
            sock.settimeout(5)
            assert b"stored" in sock.recv(4096)
        assert httpd.handlers.body_reads == 2
    finally:
        httpd.shutdown()


def test_authenticated_slow_bodies_are_cut_at_the_read_deadline():
    httpd, address = _serve(io_timeout_s=0.5, idle_timeout_s=5)
    try:
        secret = NeighbourClient(address, retries=0, token=ADMIN).open_run("r", 2, 5, 3)
        host, port = address.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(_head("/runs/r/submit", secret, length=500) + b"{")
            for _ in range(3):  # a byte now and then does not extend the deadline
                time.sleep(0.2)
                try:
                    sock.sendall(b" ")
                except OSError:
                    break
            reply, _ = _reply(sock)
        assert _status(reply) == 408 and b"not received within 0.5s" in reply
    finally:
        httpd.shutdown()


# -- per-address limits ---------------------------------------------------------------------------
def test_one_address_cannot_hold_more_than_its_connections(strangers_elsewhere):
    httpd, address = _serve(max_connections_per_address=4, max_connections=6, idle_timeout_s=5)
    try:
        held = [_connect_as(address, strangers_elsewhere) for _ in range(4)]  # half-open: they send nothing
        time.sleep(0.2)
        extra = _connect_as(address, strangers_elsewhere)  # the held ones are young: nothing to displace yet
        reply, waited = _reply(extra)
        assert _status(reply) == 503 and b"too many connections from your address (4)" in reply and waited < 1.0
        assert _health(address)[0] == 200  # another address is still served
        secret = NeighbourClient(address, retries=0, token=ADMIN).open_run("r", 2, 5, 3)
        NeighbourClient(address, retries=0, token=secret).submit("r", "a" * 32, np.zeros(2), [TOKEN])
        assert httpd.gate.connections.get("stranger") == 4
        time.sleep(httpd.gate.evict_after_s)
        newcomer = _connect_as(address, strangers_elsewhere)  # now it displaces the longest-idle one of its address
        newcomer.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _status(_reply(newcomer)[0]) == 200
        assert _reply(held[0], wait=2)[0] == b""  # the oldest was closed to make room
        assert httpd.gate.connections.get("stranger", 0) <= 4 and httpd.gate.displaced == 1
        for sock in [*held, extra, newcomer]:
            sock.close()
    finally:
        httpd.shutdown()


def test_a_connection_being_served_is_never_displaced(strangers_elsewhere):
    httpd, address = _serve(max_connections_per_address=2, io_timeout_s=1.5, idle_timeout_s=1)
    try:
        secret = NeighbourClient(address, retries=0, token=ADMIN).open_run("r", 2, 5, 3)
        busy = [_connect_as(address, strangers_elsewhere) for _ in range(2)]
        for sock in busy:  # requests in progress: authenticated bodies still arriving
            sock.sendall(_head("/runs/r/submit", secret, length=500) + b"{")
        time.sleep(httpd.gate.evict_after_s + 0.1)
        extra = _connect_as(address, strangers_elsewhere)
        assert _status(_reply(extra)[0]) == 503 and httpd.gate.displaced == 0
        for sock in busy:
            assert _status(_reply(sock)[0]) == 408  # they end at their own deadline, not earlier
            sock.close()
        extra.close()
    finally:
        httpd.shutdown()


def test_one_address_cannot_take_every_request_slot(strangers_elsewhere):
    httpd, address = _serve(max_inflight_per_address=2, max_inflight=4, io_timeout_s=1.5, idle_timeout_s=5)
    try:
        secret = NeighbourClient(address, retries=0, token=ADMIN).open_run("r", 2, 5, 3)
        slow = []
        for _ in range(2):  # a run member from the stranger's address: authenticated slow bodies
            sock = _connect_as(address, strangers_elsewhere)
            sock.sendall(_head("/runs/r/submit", secret, length=500) + b"{")
            slow.append(sock)
        time.sleep(0.3)
        assert httpd.gate.inflight.get("stranger") == 2
        third = _connect_as(address, strangers_elsewhere)
        third.sendall(_head("/runs/r/submit", secret, length=2) + b"{}")
        reply, _ = _reply(third)
        assert _status(reply) == 503 and b"too many requests in flight from your address (2)" in reply
        start = time.monotonic()  # others are served meanwhile, and /health always
        client = NeighbourClient(address, retries=0, timeout_s=2, token=secret)
        client.submit("r", "a" * 32, np.zeros(2), [TOKEN])
        assert client.neighbours("r", "a" * 32).shape == (0, 2)
        assert _health(address)[0] == 200 and time.monotonic() - start < 1.0
        for sock in slow:
            assert _status(_reply(sock)[0]) == 408  # cut at the body deadline
            sock.close()
        third.close()
        assert not httpd.gate.inflight
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("exempt", [1, 0])
def test_loopback_clients_skip_per_address_limits_unless_told(exempt):
    """A simulation's devices all come from 127.0.0.1; --exempt-loopback 0 limits them like any address."""
    httpd, address = _serve(max_connections_per_address=3, max_connections=10, idle_timeout_s=5, exempt_loopback=exempt)
    try:
        host, port = address.split(":")
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        time.sleep(0.2)
        status, _ = _health(address)
        assert status == (200 if exempt else 503)
        for sock in held:
            sock.close()
    finally:
        httpd.shutdown()


def test_address_keys_group_ipv6_by_64_and_unmap_ipv4():
    key, is_loopback = gate_module.address_key, gate_module.is_loopback
    assert key(("10.1.2.3", 5)) == "10.1.2.3"
    assert key(("::ffff:10.1.2.3", 5, 0, 0)) == "10.1.2.3"
    assert key(("2001:db8:1:2:aaaa::1", 5, 0, 0)) == key(("2001:db8:1:2:bbbb::9", 7, 0, 0)) == "2001:db8:1:2::/64"
    assert key(("2001:db8:1:3::1", 5, 0, 0)) != key(("2001:db8:1:2::1", 5, 0, 0))
    assert key(("::1", 5, 0, 0)) == "::1" and is_loopback("::1") and is_loopback("127.0.0.9")
    assert not is_loopback("2001:db8:1:2::/64") and not is_loopback("10.1.2.3")


# -- storage budgets ------------------------------------------------------------------------------
def _fill(svc: NeighbourService, run: str, dim: int = 4, tokens: int = 50, secret=None, limit: int = 10_000) -> int:
    """Submit fresh handles with fresh tokens until the run refuses; how many were stored."""
    for n in range(limit):
        try:
            svc.submit(run, secrets.token_hex(16), [0.5] * dim, [secrets.token_hex(16) for _ in range(tokens)], secret)
        except RequestError as exc:
            assert exc.status == 429 and f"run '{run}' storage budget exhausted" in str(exc), exc
            return n
    raise AssertionError("the run was never refused")


def test_each_run_has_its_own_storage_budget():
    svc = NeighbourService(Limits(max_memory_bytes=8 << 20, max_runs=4, max_entries=1000, max_dim=8, max_tokens=100,
                                  max_neighbours=10))
    share = svc.default_run_budget()
    assert share == svc.budget.data_pool // 4 > 0
    for run in "abc":
        svc.open_run(run, 4, 100, 10)
    assert _fill(svc, "a") > 10 and 0.8 * share < svc.runs["a"].stored_bytes <= share  # a is full ...
    svc.submit("b", "b" * 32, [1, 1, 1, 1], [TOKEN])  # ... and b, c are not touched by it
    assert _fill(svc, "c") > 10 and svc.runs["b"].stored_bytes < 20_000
    with pytest.raises(RequestError, match="cannot reserve .* the data pool has") as err:  # a 4th run asks for more
        svc.open_run("d", 4, 100, 10, memory_bytes=share + 1)
    assert err.value.status == 507
    svc.open_run("d", 4, 100, 10, memory_bytes=share)
    svc.close_run("a")  # closing gives a's budget back
    assert svc.budget.run_reserved == 3 * share
    svc.open_run("e", 4, 100, 10, memory_bytes=share)
    with pytest.raises(RequestError, match="memory_bytes must be an integer"):
        svc.open_run("f", 4, 100, 10, memory_bytes=True)


def test_a_run_opened_over_http_reserves_its_budget_and_stats_show_it():
    httpd, address = _serve(max_memory_bytes=256 << 20, max_runs=4, max_connections=64)
    try:
        admin = NeighbourClient(address, retries=0, token=ADMIN)
        secret = admin.open_run("big", 4, 100, 10, memory_bytes=1 << 20)
        admin.open_run("small", 4, 100, 10)
        NeighbourClient(address, retries=0, token=secret).submit("big", "a" * 32, np.zeros(4), [TOKEN])
        stats = admin.stats()
        assert stats["runs"]["big"]["budget_bytes"] == 1 << 20 and stats["runs"]["big"]["entries"] == 1
        assert stats["runs"]["small"]["budget_bytes"] == httpd.service.default_run_budget()
        assert stats["reserved_by_runs"] == (1 << 20) + stats["runs"]["small"]["budget_bytes"] <= stats["data_pool"]
        assert secret not in json.dumps(stats) and secret not in repr(httpd.service.runs["big"])
        with pytest.raises(NeighbourServiceError, match="missing admin token"):
            NeighbourClient(address, retries=0).stats()
    finally:
        httpd.shutdown()


def test_stored_bytes_are_counted_from_what_is_kept():
    """The count is at least what tracemalloc sees allocated and at most the allocator's rounding above it
    (tracemalloc sees requested sizes; the process test below checks the count against the RSS)."""
    rng = np.random.default_rng(0)
    items = [secrets.token_hex(16) for _ in range(3000)]
    subs = [(secrets.token_hex(16), rng.standard_normal(16).tolist(),
             json.loads(json.dumps([items[i] for i in rng.choice(3000, 30, replace=False)]))) for _ in range(800)]
    del items
    svc = NeighbourService(Limits(max_memory_bytes=1 << 30))
    svc.open_run("r", 16, 100, 10)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for h, e, t in subs:
            svc.submit("r", h, e, t)
        del subs, h, e, t
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    counted = svc.runs["r"].stored_bytes - RUN_FIXED_BYTES
    assert traced < counted < 1.6 * traced, (counted, traced)  # 16-byte blocks and malloc headers: RSS sees them


def test_the_service_process_stays_within_its_memory_limit():
    """Fill every run to its budget through HTTP; the process's peak RSS stays within 1.2 x --max-memory-bytes."""
    limit = 160_000_000
    address, proc, token = start_local_service(extra_args=[
        "--max-memory-bytes", str(limit), "--max-runs", "2", "--max-connections", "256"])
    try:
        admin = NeighbourClient(address, retries=0, token=token)
        stats = admin.stats()
        assert stats["fixed"]["process"] > 0 and stats["data_pool"] > 20_000_000
        rng, refused = np.random.default_rng(0), 0
        for run in ("r0", "r1"):
            client = NeighbourClient(address, retries=0, token=admin.open_run(run, 64, 2000, 10))
            for _ in range(2000):
                try:
                    client.submit(run, secrets.token_hex(16), rng.standard_normal(64),
                                  [secrets.token_hex(16) for _ in range(2000)])
                except NeighbourServiceError as exc:
                    assert "storage budget exhausted" in str(exc)
                    refused += 1
                    break
        stats = admin.stats()
        peak = int(next(line.split()[1] for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                        if line.startswith("VmHWM:"))) * 1024
        assert refused == 2 and stats["stored_bytes"] > 0.8 * stats["reserved_by_runs"], stats
        print(f"peak RSS {peak} bytes = {peak / limit:.3f} x --max-memory-bytes {limit}; "
              f"stored {stats['stored_bytes']}")
        assert peak < 1.2 * limit, (peak, stats)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_memory_limit_below_what_the_process_needs_is_refused_at_start(monkeypatch, capsys):
    monkeypatch.setenv("FEDREC_NB_ADMIN_TOKEN", ADMIN)
    with socket.socket() as sock:  # a port that is free now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SystemExit) as exit_:
        service_main(["--host", "127.0.0.1", "--port", str(port), "--max-memory-bytes", "20000000"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--max-memory-bytes 20000000 leaves no room for data" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_large_reply_is_streamed_and_arrives_whole():
    httpd, address = _serve(max_memory_bytes=1 << 30)
    try:
        secret = NeighbourClient(address, retries=0, token=ADMIN).open_run("big", 1024, 5, 60)
        client = NeighbourClient(address, retries=0, token=secret)
        rows = np.random.default_rng(0).standard_normal((41, 1024)).astype(np.float32)
        for i, row in enumerate(rows):
            client.submit("big", f"{i:032x}", row, [TOKEN])
        got = client.neighbours("big", f"{0:032x}")  # 40 x 1024 values: over the 1 MiB sent whole
        assert got.shape == (40, 1024) and np.array_equal(got, rows[1:])
        assert httpd.service.budget.request_used == 0  # every request gave its working memory back
    finally:
        httpd.shutdown()


def test_limits_out_of_range_are_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("FEDREC_NB_ADMIN_TOKEN", ADMIN)
    for flags, message in ((["--max-connections", "0"], "--max-connections must be an integer >= 1, got 0"),
                           (["--io-timeout-s", "-1"], "--io-timeout-s must be a positive number of seconds"),
                           (["--max-memory-bytes", "x"], "invalid int value"),
                           (["--exempt-loopback", "2"], "--exempt-loopback must be 0 or 1")):
        with pytest.raises(SystemExit) as exit_:
            service_main(["--port", "8765", *flags])  # refused before anything listens
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="max-inflight-per-address must be an integer >= 1"):
        NeighbourService(Limits(max_inflight_per_address=0))


def _bad_flag_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    short, garbage = tmp_path / "short-token", tmp_path / "garbage.pem"
    short.write_text("abc\n")
    garbage.write_text("not a certificate\n")
    missing = str(tmp_path / "missing")
    return [
        (["--port", "70000"], "argument --port: expected a TCP port in 1-65535, got '70000'"),
        (["--port", "0"], "argument --port: expected a TCP port in 1-65535"),
        (["--port", "http"], "argument --port: expected a TCP port in 1-65535"),
        (["--host", " "], "--host must be a host name or IP address"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be an integer >= 1, got 0"),
        (["--max-runs", "1.5"], "argument --max-runs: invalid int value"),
        (["--idle-timeout-s", "nan"], "--idle-timeout-s must be a positive number of seconds"),
        (["--run-ttl-s", "inf"], "--run-ttl-s must be a positive number of seconds"),
        (["--parent-pid", "-3"], "argument --parent-pid: expected a process id"),
        (["--parent-pid", str(os.getpid())], f"--parent-pid {os.getpid()} is not this process's parent"),
        (["--admin-token-file", missing], f"--admin-token-file {missing}: cannot read it"),
        (["--admin-token-file", str(short)], "an admin token of at least 16 characters is required"),
        (["--certfile", str(garbage)], "--certfile and --keyfile go together"),
        (["--certfile", missing, "--keyfile", str(garbage)], f"--certfile {missing}: no such file"),
        (["--certfile", str(garbage), "--keyfile", str(garbage)], "not a PEM certificate and its private key"),
        (["--max-connection", "5"], "unrecognized arguments: --max-connection"),  # no abbreviations
    ]


def test_bad_flags_print_one_line_naming_the_flag_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDREC_NB_ADMIN_TOKEN", ADMIN)
    for flags, message in _bad_flag_cases(tmp_path):
        with pytest.raises(SystemExit) as exit_:
            service_main(["--host", "127.0.0.1", "--port", "8765", *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2, flags
        assert err.startswith("error: fedrec-neighbour-service: ") and err.count("\n") == 1, err
        assert message in err and "Traceback" not in err, (flags, err)
    with socket.socket() as taken:  # an address already in use: one line naming --host and --port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            service_main(["--host", "127.0.0.1", "--port", str(port)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in err, err


def test_the_console_script_refuses_a_bad_port_without_a_traceback():
    """`python -m fedrec_flwr.neighbours.cli --port 70000`, as an operator would run it: one line, exit 2."""
    env = {**os.environ, "FEDREC_NB_ADMIN_TOKEN": ADMIN}
    proc = subprocess.run([sys.executable, "-m", "fedrec_flwr.neighbours.cli", "--port", "70000"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.splitlines() == ["error: fedrec-neighbour-service: argument --port: expected a TCP port in "
                                        "1-65535, got '70000' (see `fedrec-neighbour-service --help`)"], proc.stderr


def test_refusals_log_one_line_each_and_no_traceback(caplog):
    httpd, address = _serve(idle_timeout_s=2, io_timeout_s=2)
    host, port = address.split(":")
    try:
        with caplog.at_level(logging.DEBUG):
            for data in (_head("/runs/r/submit", length=3) + b"{}}", b"GARBAGE\r\n\r\n",
                         _head("/nowhere", ADMIN, length=2) + b"{}", _head("/runs", ADMIN, length=9) + b"{not json",
                         b"POST /runs HTTP/1.1\r\nContent-Length: x\r\n\r\n"):
                with socket.create_connection((host, int(port)), timeout=5) as sock:
                    sock.sendall(data)
                    assert _status(_reply(sock)[0]) in (400, 401, 404)
            time.sleep(0.2)
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 5
        assert all(r.exc_info is None and "\n" not in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records if r.exc_info]
    finally:
        httpd.shutdown()


# -- the device checks the service's replies --------------------------------------------------------
class _Hostile(http.server.BaseHTTPRequestHandler):
    reply: bytes = b"{}"

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.reply)))
        self.end_headers()
        self.wfile.write(self.reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server, f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _rows(n, dim, value=0.5):
    return [[value] * dim for _ in range(n)]


@pytest.mark.parametrize("reply, message", [
    (json.dumps({"embeddings": _rows(2, 3), "dim": 3}).encode(), "dimension 3, but this run's embeddings have 4"),
    (json.dumps({"embeddings": _rows(2, 3), "dim": 4}).encode(), "row 0 is not a list of 4 numbers"),
    (json.dumps({"embeddings": _rows(6, 4), "dim": 4}).encode(), "6 neighbours, more than max_neighbours 5"),
    (b'{"embeddings": [[0.5, NaN, 0.5, 0.5]], "dim": 4}', "row 0 holds 'nan', not a finite float32 number"),
    (b'{"embeddings": [[0.5, 0.5, 0.5, -Infinity]], "dim": 4}', "not a finite float32 number"),
    (b'{"embeddings": [[0.5, 0.5, 0.5, 1e39]], "dim": 4}', "row 0 holds '1e+39'"),  # finite in float64, inf in float32
    (b'{"embeddings": [[0.5, 0.5, 0.5, 1' + b"0" * 400 + b']], "dim": 4}', "not a finite float32 number"),
    (b'{"embeddings": [[0.5, 0.5, "0.5", 0.5]], "dim": 4}', "row 0 holds '0.5'"),
    (b'{"embeddings": [[0.5, 0.5, true, 0.5]], "dim": 4}', "row 0 holds 'True'"),
    (b'{"embeddings": [[0.5, 0.5, [0.5], 0.5]], "dim": 4}', "not a finite float32 number"),
    (b'{"embeddings": {"0": 1}, "dim": 4}', "'embeddings' must be a list of rows"),
    (b'{"embeddings": [], "dim": true}', "'dim' must be an integer"),
    (b'{"dim": 4}', "'embeddings' must be a list of rows"),
    (b"<html>busy</html>", "not JSON"),
    (b"[[0.5, 0.5, 0.5, 0.5]]", "a JSON list, not an object"),
    (json.dumps({"embeddings": _rows(5, 4, 0.123456789), "dim": 4, "pad": "x" * 100_000}).encode(), "more than"),
])
def test_a_device_refuses_hostile_neighbour_replies(hostile, reply, message):
    server, address = hostile
    server.RequestHandlerClass = type("H", (_Hostile,), {"reply": reply})
    client = NeighbourClient(address, retries=0, token="s" * 64, dim=4, max_neighbours=5)
    with pytest.raises(NeighbourServiceError, match="sent an invalid reply to /runs/r/neighbours: ") as err:
        client.neighbours("r", "a" * 32)
    assert message in str(err.value)


def test_the_device_checks_against_what_it_knows_of_the_run(hostile):
    server, address = hostile
    server.RequestHandlerClass = type("H", (_Hostile,),
                                      {"reply": json.dumps({"embeddings": _rows(3, 8), "dim": 8}).encode()})
    # nothing known of the run: the reply need only be self-consistent
    assert NeighbourClient(address, retries=0).neighbours("r", "a" * 32).shape == (3, 8)
    assert NeighbourClient(address, retries=0).neighbours("r", "a" * 32, dim=8, max_neighbours=3).dtype == np.float32
    with pytest.raises(NeighbourServiceError, match="dimension 8, but this run's embeddings have 4"):
        NeighbourClient(address, retries=0).neighbours("r", "a" * 32, dim=4)
    with pytest.raises(NeighbourServiceError, match="3 neighbours, more than max_neighbours 2"):
        NeighbourClient(address, retries=0, max_neighbours=2).neighbours("r", "a" * 32)
    server.RequestHandlerClass = type("H", (_Hostile,), {"reply": b'{"status": "stored"}'})
    device = NeighbourClient(address, retries=0)
    device.submit("r", "a" * 32, np.zeros(4), [TOKEN])  # the dim this device submitted is the run's
    server.RequestHandlerClass = type("H", (_Hostile,),
                                      {"reply": json.dumps({"embeddings": _rows(1, 8), "dim": 8}).encode()})
    with pytest.raises(NeighbourServiceError, match="dimension 8, but this run's embeddings have 4"):
        device.neighbours("r", "a" * 32)
    server.RequestHandlerClass = type("H", (_Hostile,), {"reply": b'{"status": "open", "secret": ["x"]}'})
    with pytest.raises(NeighbourServiceError, match="the run secret is not a short printable ASCII string"):
        NeighbourClient(address, retries=0).open_run("r", 4, 5, 3)
    with pytest.raises(NeighbourServiceError, match="refusing to submit .* finite vector"):
        device.submit("r", "a" * 32, np.array([0.0, np.nan]), [TOKEN])
