"""Graph expansion: keyed tokens, the neighbour service's matching, credentials, bounds and refusals."""

from __future__ import annotations

import hashlib
import http.client
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from fedrec_flwr.data.synthetic import make_synthetic
from fedrec_flwr.fedgnn.protocol import PHASE_EXPAND_SUBMIT, ExpansionLink, RoundConfig
from fedrec_flwr.neighbours import (
    Limits,
    NeighbourClient,
    NeighbourService,
    NeighbourServiceError,
    RequestError,
    item_tokens,
    new_handle,
    new_run_key,
    serve,
)
from fedrec_flwr.neighbours.cli import main as service_main
from fedrec_flwr.neighbours.http_app import SUBMIT_BYTES_FIXED, SUBMIT_BYTES_PER_TOKEN, SUBMIT_BYTES_PER_VALUE
from fedrec_flwr.neighbours.process import start_local_service

ROOT = Path(__file__).resolve().parent.parent
ADMIN = "a" * 64
TOKEN = "1" * 32


@pytest.fixture
def service():
    httpd, thread = serve("127.0.0.1", 0)
    yield httpd, f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture
def secured():
    """A service that checks credentials, with short timeouts so slow clients are cut within a test."""
    httpd, _ = serve("127.0.0.1", 0, admin_token=ADMIN,
                     limits=Limits(idle_timeout_s=0.5, io_timeout_s=0.5, max_body_bytes=1 << 16))
    yield httpd, f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _request(address: str, path: str, body=None, token: str | None = None, method: str = "POST",
             raw: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """One HTTP request; (status, JSON body). Fails the test if the reply is not JSON."""
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def _raw(address: str, data: bytes, wait: float = 5.0) -> tuple[int | None, dict | None, float]:
    """Send raw bytes, read until the server closes; (status, JSON body or None, seconds until closed)."""
    host, port = address.split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    elapsed = time.monotonic() - start
    if not reply:
        return None, None, elapsed
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), elapsed


def _open(address: str, run: str = "r", dim: int = 2, max_tokens: int = 5, max_neighbours: int = 3, **kw) -> str:
    return NeighbourClient(address, retries=0, token=ADMIN).open_run(run, dim, max_tokens, max_neighbours, **kw)


def _users(n=40, seed=0):
    ds = make_synthetic(seed=seed, num_users=n, num_items=60, mean_degree=6)
    return [np.unique(ds.train.items[ds.train.users == u]) for u in range(n)]


# -- matching -------------------------------------------------------------------------------
def test_matching_equals_brute_force(secured):
    _, address = secured
    key, dim = new_run_key(), 4
    users = _users()
    secret = _open(address, "r1", dim, 100, 1000)
    client = NeighbourClient(address, token=secret)
    handles = [new_handle() for _ in users]
    embs = np.random.default_rng(0).standard_normal((len(users), dim)).astype(np.float32)
    for h, items, e in zip(handles, users, embs):
        client.submit("r1", h, e, item_tokens(key, items))
    matched = 0
    for u, h in enumerate(handles):
        got = {tuple(np.round(row, 5)) for row in client.neighbours("r1", h)}
        expected = {tuple(np.round(embs[v], 5)) for v in range(len(users))
                    if v != u and np.intersect1d(users[u], users[v]).size}
        assert got == expected
        matched += len(expected)
    assert matched > 0  # co-raters exist, so an empty answer for everyone would not pass


def test_neighbour_cap_prefers_most_shared_items():
    svc = NeighbourService()
    svc.open_run("r", 2, 10, 1)
    svc.submit("r", "a" * 32, [0, 0], ["1" * 32, "2" * 32])
    svc.submit("r", "b" * 32, [1, 1], ["1" * 32])
    svc.submit("r", "c" * 32, [2, 2], ["1" * 32, "2" * 32])
    assert svc.neighbours("r", "a" * 32).tolist() == [[2.0, 2.0]]


def test_user_never_receives_its_own_embedding():
    svc = NeighbourService()
    svc.open_run("r", 3, 10, 10)
    svc.submit("r", "a" * 32, [9, 9, 9], ["1" * 32])
    assert svc.neighbours("r", "a" * 32).shape == (0, 3)  # alone: nothing, not itself
    svc.submit("r", "b" * 32, [1, 2, 3], ["1" * 32])
    assert svc.neighbours("r", "a" * 32).tolist() == [[1, 2, 3]]
    assert svc.neighbours("r", "b" * 32).tolist() == [[9, 9, 9]]


def test_random_matching_draws_other_users_whatever_they_rated():
    """match = random: N other handles, never the asker, even when no token is shared; the shared-items run
    over the same submissions finds nobody."""
    shared, random_run = NeighbourService(), NeighbourService()
    shared.open_run("r", 1, 10, 3)
    random_run.open_run("r", 1, 10, 3, match="random")
    for i in range(6):  # every handle rated an item of its own
        for svc in (shared, random_run):
            svc.submit("r", f"{i:032x}", [float(i)], [f"{i + 1:032x}"])
    assert shared.neighbours("r", f"{0:032x}").shape == (0, 1)
    seen = set()
    for _ in range(20):
        rows = random_run.neighbours("r", f"{0:032x}")[:, 0].tolist()
        assert len(rows) == 3 and len(set(rows)) == 3 and 0.0 not in rows
        seen.update(rows)
    assert seen == {1.0, 2.0, 3.0, 4.0, 5.0}  # every other handle comes up (20 draws of 3 of 5)


def _unkeyed_guesses(ids) -> dict[str, int]:
    """What someone without the key can compute from item ids: plain encodings and unkeyed hashes."""
    out = {}
    for i in ids:
        i = int(i)
        for text in (b"%d" % i, b"item:%d" % i):
            out[hashlib.sha256(text).hexdigest()[:32]] = i
            out[hashlib.md5(text).hexdigest()] = i  # noqa: S324 (an attacker's guess, not our use)
        out[f"{i:032x}"] = i
    return out


def test_tokens_under_another_key_share_nothing_and_service_holds_no_key(service, monkeypatch):
    _, address = service
    key, items = new_run_key(), np.arange(500)
    real, other = item_tokens(key, items), item_tokens(new_run_key(), items)
    assert len(set(real)) == 500 and not set(real) & set(other)
    sent: list[str] = []
    original = NeighbourClient._post
    monkeypatch.setattr(NeighbourClient, "_post",
                        lambda self, path, body: sent.append(json.dumps(body)) or original(self, path, body))
    client = NeighbourClient(address)
    client.open_run("k", 2, 600, 5)
    client.submit("k", new_handle(), np.zeros(2), real)
    assert sent and not any(key.hex() in s or str(list(key)) in s for s in sent)  # the key never goes out
    body = json.loads(sent[-1])  # nor item ids: the submit holds a handle, the embedding and keyed tokens only
    assert set(body) == {"handle", "embedding", "tokens"} and body["tokens"] == real
    guesses = _unkeyed_guesses(items)
    assert not set(body["tokens"]) & set(guesses)  # no id is recovered by encoding or hashing ids without the key
    leaky = [hashlib.sha256(b"item:%d" % i).hexdigest()[:32] for i in items]  # what the check catches: unkeyed tokens
    assert {guesses[t] for t in leaky} == set(items.tolist())
    with pytest.raises(ValueError, match="128 bits"):
        item_tokens(b"short", items)


# -- refusals of the matching state ---------------------------------------------------------
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: s.submit("r", "a" * 32, [0, 0], ["xyz"]), "malformed token"),
        (lambda s: s.submit("r", "a" * 32, [0, 0], ["1" * 32] * 6), "too many tokens: 6 > limit 5"),
        (lambda s: s.submit("r", "not-a-handle", [0, 0], ["1" * 32]), "handle must be"),
        (lambda s: s.submit("r", "a" * 32, [0, float("nan")], ["1" * 32]), "2 finite numbers"),
        (lambda s: s.submit("r", "a" * 32, [0, 10**400], ["1" * 32]), "2 finite numbers"),
        (lambda s: s.submit("r", "a" * 32, ["0", "1"], ["1" * 32]), "2 finite numbers"),
        (lambda s: s.submit("r", "a" * 32, [0, 0], "1" * 32), "tokens must be a non-empty list"),
        (lambda s: s.submit("nope", "a" * 32, [0, 0], ["1" * 32]), "unknown run 'nope'"),
        (lambda s: s.neighbours("nope", "a" * 32), "unknown run 'nope'"),
        (lambda s: s.neighbours("r", ["a" * 32]), "has not submitted"),
        (lambda s: s.open_run("x", "2", 5, 3), "dim must be an integer"),
        (lambda s: s.open_run("x", 2, 5, 3, updates="yes"), "updates must be true or false"),
        (lambda s: s.open_run("x", 2, 5, 3, match="nearest"), "match must be one of"),
        (lambda s: s.open_run("r", 2, 5, 3, match="random"), "already open with other settings"),
        (lambda s: s.open_run("r", 3, 5, 3), "already open with other settings"),
    ],
)
def test_bad_requests_are_refused_with_clear_errors(call, message):
    svc = NeighbourService()
    svc.open_run("r", 2, 5, 3)
    with pytest.raises(RequestError, match=message):
        call(svc)


# -- credentials ----------------------------------------------------------------------------
def test_only_the_operator_opens_and_closes_runs_and_only_their_clients_write_and_read(secured):
    _, address = secured
    spec = {"run_id": "r", "dim": 2, "max_tokens": 5, "max_neighbours": 3}
    assert _request(address, "/runs", spec)[0] == 401
    assert _request(address, "/runs", spec, token="b" * 64) == (403, {"error": "wrong admin token"})
    status, opened = _request(address, "/runs", spec, token=ADMIN)
    secret = opened["secret"]
    assert status == 200 and len(secret) == 64 and secret != ADMIN
    other = _request(address, "/runs", {**spec, "run_id": "other"}, token=ADMIN)[1]["secret"]
    entry = {"handle": "c" * 32, "embedding": [1, 2], "tokens": [TOKEN]}
    for path, body in (("/runs/r/submit", entry), ("/runs/r/neighbours", {"handle": "c" * 32})):
        assert _request(address, path, body)[0] == 401  # no secret
        assert _request(address, path, body, token="f" * 64)[0] == 403  # a wrong one
        assert _request(address, path, body, token=other)[0] == 403  # another run's
        assert _request(address, path, body, token=ADMIN)[0] == 403  # the admin token is not a run secret
    assert _request(address, "/runs/r/submit", entry, token=secret) == (200, {"status": "stored"})
    assert _request(address, "/runs/r/neighbours", {"handle": "c" * 32}, token=secret) == (
        200, {"embeddings": [], "dim": 2})
    assert _request(address, "/runs/r/close", {}, token=secret)[0] == 403  # a client cannot end the run
    assert _request(address, "/runs/r/close", {})[0] == 401
    assert _request(address, "/runs/r/close", {}, token=ADMIN) == (200, {"status": "closed"})


def test_round_config_carries_the_run_secret_and_never_the_closer():
    closed = []
    link = ExpansionLink(new_run_key(), "127.0.0.1:1", "r", "s" * 64, close_run=lambda: closed.append(1))
    flat = RoundConfig(PHASE_EXPAND_SUBMIT, 2, expansion=link).to_flower()
    assert flat["nb_secret"] == "s" * 64 and not any(callable(v) for v in flat.values())
    back = RoundConfig.from_flower(flat).expansion
    assert (back.secret, back.run_id, back.close_run) == ("s" * 64, "r", None)
    assert "s" * 64 not in repr(link) and not closed


def test_a_handle_is_written_once_unless_the_run_takes_updates(secured):
    _, address = secured
    client = NeighbourClient(address, retries=0, token=_open(address, "once"))
    client.submit("once", "a" * 32, np.array([1.0, 2.0]), [TOKEN])
    client.submit("once", "a" * 32, np.array([1.0, 2.0]), [TOKEN])  # the same again (a retry): accepted
    with pytest.raises(NeighbourServiceError, match="already submitted to this run"):
        client.submit("once", "a" * 32, np.array([5.0, 5.0]), [TOKEN])
    status, body = _request(address, "/runs/once/submit", {"handle": "a" * 32, "embedding": [0, 0], "tokens": [TOKEN]},
                            token=client.token)
    assert status == 409 and "already submitted" in body["error"]
    updating = NeighbourClient(address, retries=0, token=_open(address, "upd", updates=True))
    updating.submit("upd", "a" * 32, np.array([1.0, 1.0]), [TOKEN])
    updating.submit("upd", "b" * 32, np.array([2.0, 2.0]), [TOKEN])
    updating.submit("upd", "b" * 32, np.array([3.0, 3.0]), ["2" * 32])  # trainable expansion: re-submits
    assert updating.neighbours("upd", "a" * 32).shape == (0, 2)  # b's old token is gone from the index


# -- bounds -----------------------------------------------------------------------------------
def test_limits_on_runs_handles_tokens_dimensions_and_storage():
    svc = NeighbourService(Limits(max_runs=2, max_entries=2, max_tokens=4, max_dim=8, max_neighbours=5,
                                  max_memory_bytes=1 << 20))
    svc.open_run("a", 2, 4, 5)
    svc.open_run("b", 2, 4, 5, memory_bytes=9000)  # its own storage budget: little more than an empty run
    for call, status, message in (
        (lambda: svc.open_run("c", 2, 4, 5), 429, "too many open runs"),
        (lambda: svc.open_run("d", 9, 4, 5), 400, r"dim must be an integer in \[1, 8\]"),
        (lambda: svc.open_run("d", 2, 5, 5), 400, r"max_tokens must be an integer in \[1, 4\]"),
        (lambda: svc.open_run("d", 2, 4, 6), 400, r"max_neighbours must be an integer in \[1, 5\]"),
        (lambda: svc.submit("a", "a" * 32, [0, 0], [TOKEN] * 5), 413, "too many tokens: 5 > limit 4"),
    ):
        with pytest.raises(RequestError, match=message) as err:
            call()
        assert err.value.status == status
    svc.submit("a", "a" * 32, [0, 0], [TOKEN])
    svc.submit("a", "b" * 32, [0, 0], [TOKEN])
    with pytest.raises(RequestError, match="run is full") as err:
        svc.submit("a", "c" * 32, [0, 0], [TOKEN])
    assert err.value.status == 429
    with pytest.raises(RequestError, match="run 'b' storage budget exhausted: 8192 of its 9000 bytes used") as err:
        svc.submit("b", "b" * 32, [0, 0], ["4" * 32, "5" * 32, "6" * 32, "7" * 32])
    assert err.value.status == 429 and not svc.runs["b"].handles  # refused before anything was stored
    svc.close_run("b")  # closing gives its budget back; a larger one fits now
    svc.open_run("b", 2, 4, 5, memory_bytes=64_000)
    svc.submit("b", "b" * 32, [0, 0], ["4" * 32, "5" * 32, "6" * 32, "7" * 32])


# what a submit to _open's run (5 tokens, dim 2) may take at most
SUBMIT_LIMIT = SUBMIT_BYTES_FIXED + 5 * SUBMIT_BYTES_PER_TOKEN + 2 * SUBMIT_BYTES_PER_VALUE


def test_oversized_bodies_are_refused_with_413(secured):
    _, address = secured  # max_body_bytes = 64 KiB; a submit to this run needs at most SUBMIT_LIMIT
    secret = _open(address)
    big = json.dumps({"handle": "a" * 32, "embedding": [0] * 40_000, "tokens": [TOKEN]}).encode()
    status, body = _request(address, "/runs/r/submit", raw=big, token=secret)
    assert status == 413 and f"over {SUBMIT_LIMIT} bytes" in body["error"]
    chunks = iter([big[i: i + 8192] for i in range(0, len(big), 8192)])  # no Content-Length: counted while read
    status, body = _request(address, "/runs/r/submit", raw=chunks, token=secret)  # http.client sends it chunked
    assert status == 413 and f"over {SUBMIT_LIMIT} bytes" in body["error"]
    status, body = _request(address, "/runs", raw=b" " * 5000, token=ADMIN)  # admin bodies are a few fields
    assert status == 413 and "over 4096 bytes" in body["error"]


def test_busy_service_answers_503_and_the_client_retries_then_reports_it():
    httpd, _ = serve("127.0.0.1", 0, limits=Limits(max_inflight=0))
    try:
        client = NeighbourClient(f"127.0.0.1:{httpd.server_address[1]}", retries=1, backoff_s=0.01)
        with pytest.raises(NeighbourServiceError, match="refused /runs: service busy"):
            client.open_run("r", 2, 5, 3)
    finally:
        httpd.shutdown()


def test_abandoned_runs_expire_after_the_ttl_and_activity_keeps_them():
    now = [0.0]
    svc = NeighbourService(Limits(run_ttl_s=100), admin_token=ADMIN, clock=lambda: now[0])
    secret = svc.open_run("r", 2, 5, 3, admin_token=ADMIN)
    svc.open_run("idle", 2, 5, 3, admin_token=ADMIN)
    now[0] = 90
    svc.submit("r", "a" * 32, [0, 0], [TOKEN], secret=secret)  # touches "r" only
    now[0] = 150
    assert svc.expire() == ["idle"] and list(svc.runs) == ["r"]
    assert svc.neighbours("r", "a" * 32, secret=secret).shape == (0, 2)
    now[0] = 251
    with pytest.raises(RequestError, match="unknown run 'r' .*expired") as err:
        svc.neighbours("r", "a" * 32, secret=secret)
    assert err.value.status == 404 and not svc.runs


def test_close_run_forgets_the_run(secured):
    httpd, address = secured
    admin = NeighbourClient(address, retries=0, token=ADMIN)
    client = NeighbourClient(address, retries=0, token=admin.open_run("r", 2, 5, 3))
    client.submit("r", "a" * 32, np.zeros(2), [TOKEN])
    admin.close_run("r")
    assert not httpd.service.runs
    with pytest.raises(NeighbourServiceError, match="unknown run 'r'"):
        client.neighbours("r", "a" * 32)
    with pytest.raises(NeighbourServiceError, match="refused /runs/r/close: unknown run 'r'"):
        admin.close_run("r")


def test_the_fedgnn_server_closes_its_run_when_its_last_round_ends(tiny_cfg):
    from strategies.fedgnn import FedGNNStrategy

    closed = []
    link = ExpansionLink(new_run_key(), "127.0.0.1:9", "r", "s" * 64, close_run=lambda: closed.append(1))
    strategy = FedGNNStrategy(tiny_cfg("expansion.mode=fixed", "expansion.epoch=0", "federation.rounds=1"), 80, 3.0,
                              None, 60, link, rating_span=4.0)
    strategy.aggregate_evaluate(strategy.num_rounds - 1, [], [])
    assert not closed
    strategy.aggregate_evaluate(strategy.num_rounds, [], [])
    assert closed == [1]


# -- slow, half-open and malformed connections ---------------------------------------------
def test_slow_and_half_open_clients_are_cut_off_while_honest_ones_are_served(secured):
    _, address = secured  # idle_timeout_s = io_timeout_s = 0.5
    secret = _open(address)
    host, port = address.split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(5)]  # half-open: connect, send nothing
    held[1].sendall(b"POST /runs/r/submit HTTP/1.1\r\nHost: x\r\n")  # a request head that never ends
    start = time.monotonic()
    NeighbourClient(address, retries=0, token=secret).submit("r", "a" * 32, np.zeros(2), [TOKEN])
    assert time.monotonic() - start < 0.5  # served while the others are held
    for sock in held:
        sock.settimeout(5)
        assert sock.recv(100) == b""  # closed by the service
        sock.close()
    assert time.monotonic() - start < 4
    status, body, elapsed = _raw(address, b"POST /runs/r/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n"
                                 b"Authorization: Bearer " + secret.encode() + b"\r\n\r\n{\"ha")
    assert status == 408 and "not received within 0.5s" in body["error"] and elapsed < 4  # a body that stalls


def test_a_reader_that_never_reads_its_reply_is_cut_off():
    httpd, _ = serve("127.0.0.1", 0, limits=Limits(io_timeout_s=0.5))
    svc, address = httpd.service, f"127.0.0.1:{httpd.server_address[1]}"
    try:
        svc.open_run("r", 1024, 5, 400)
        rows = np.random.default_rng(0).standard_normal((401, 1024)).tolist()
        for i, row in enumerate(rows):
            svc.submit("r", f"{i:032x}", row, [TOKEN])
        request = json.dumps({"handle": f"{0:032x}"}).encode()  # the reply is about 8 MB of neighbours
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", httpd.server_address[1]))
        sock.sendall(b"POST /runs/r/neighbours HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(request)
                     + request)
        time.sleep(3)  # never reading meanwhile
        sock.settimeout(5)
        got = 0
        try:
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        sock.close()
        assert got < 8_000_000  # the reply was abandoned, not kept for this reader
        assert _request(address, "/health", method="GET") == (200, {"status": "ok"})
    finally:
        httpd.shutdown()


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n" % (path.encode(), len(body), extra) + body


@pytest.mark.parametrize(
    "data, status, message",
    [
        (_post("/runs/r/submit", b"{not json"), 400, "not valid JSON"),
        (_post("/runs/r/submit", b"\xff\xfe"), 400, "not valid JSON"),
        (_post("/runs/r/submit", b"[1, 2]"), 400, "must be a JSON object"),
        (_post("/runs/r/submit", b""), 400, "must be a JSON object"),
        (_post("/runs/r/submit", b"[" * 1000), 400, "at most 8 arrays and objects"),  # nesting: refused unparsed
        (_post("/runs/r/submit", b"[" * 60_000), 413, f"over {SUBMIT_LIMIT} bytes"),
        (_post("/runs/r/submit", b'{"handle": 7, "embedding": [0, 0], "tokens": ["' + b"1" * 32 + b'"]}'), 400,
         "handle must be"),
        (_post("/runs/r/submit", b'{"handle": "' + b"a" * 32 + b'", "embedding": "00", "tokens": ["' + b"1" * 32
               + b'"]}'), 400, "2 finite numbers"),
        (_post("/runs/r/submit", b'{"handle": "' + b"a" * 32 + b'", "embedding": [0, 0], "tokens": {"a": 1}}'), 400,
         "tokens must be a non-empty list"),
        (_post("/runs/r/submit", b'{"handle": "' + b"a" * 32 + b'", "embedding": [1e999, 0], "tokens": ["' + b"1" * 32
               + b'"]}'), 400, "2 finite numbers"),
        (_post("/runs/ghost/submit", b"{}"), 404, "unknown run 'ghost'"),
        (_post("/runs/r/neighbours", b'{"handle": "' + b"b" * 32 + b'"}'), 404, "has not submitted"),
        (_post("/nowhere", b"{}"), 404, "no such endpoint /nowhere"),
        (_post("/runs/r/submit/extra", b"{}"), 404, "no such endpoint"),
        (b"GET /runs HTTP/1.1\r\nHost: x\r\n\r\n", 405, "GET not allowed on /runs"),
        (b"DELETE /health HTTP/1.1\r\nHost: x\r\n\r\n", 405, "DELETE not allowed on /health"),
        (b"POST /runs/r/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n{}", 413,
         f"over {SUBMIT_LIMIT} bytes"),
    ],
)
def test_malformed_requests_are_answered_with_a_json_error(secured, data, status, message):
    _, address = secured
    secret = _open(address)
    data = data.replace(b"Host: x\r\n", b"Host: x\r\nAuthorization: Bearer " + secret.encode() + b"\r\n", 1)
    got, body, _ = _raw(address, data)
    assert got == status and isinstance(body, dict) and message in body["error"], body


@pytest.mark.parametrize(
    "data, message",
    [
        (b"POST /runs/r/submit HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", "Content-Length"),
        (b"POST /runs/r/submit HTTP/1.1\r\nHost: x\r\nContent-Length: -2\r\n\r\n{}", "Content-Length"),
        (b"POST /runs/r/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
         "Content-Length"),
        (b"POST /runs/r/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{\"handle\": 1}",
         "Invalid method"),  # a Content-Length shorter than the body: the rest is no request (a longer one: 408, above)
        (b"GARBAGE\r\n\r\n", "Invalid method"),
        (b"POST /runs HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n", "2048 bytes"),
        (b"POST /runs HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(20)) + b"\r\n",
         "Too many headers"),
    ],
)
def test_requests_aiohttp_cannot_parse_are_answered_400_and_closed(secured, data, message):
    """aiohttp's parser refuses these before any route sees them: its own 400 naming the problem, then close."""
    _, address = secured
    host, port = address.split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == 400 and message.encode() in body, reply[:300]
    assert time.monotonic() - start < 1.0  # closed at once, not at the idle timeout


# -- deployment: TLS, admin token, the process ----------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if not shutil.which("openssl") or not shutil.which("ssh-keygen"):
        pytest.skip("deploy/make_certs.sh needs openssl and ssh-keygen")
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(ROOT / "deploy" / "make_certs.sh"), str(out), "1"], check=True, capture_output=True)
    return out


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie nobody reaped has finished)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")
def test_a_local_service_stops_when_the_process_that_started_it_is_killed():
    """A run killed outright (SIGKILL: no atexit) must not leave its loopback neighbour service behind."""
    code = ("from fedrec_flwr.neighbours.process import start_local_service; import time; "
            "print(start_local_service()[1].pid, flush=True); time.sleep(120)")
    starter = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    service = int(starter.stdout.readline())
    assert _running(service)
    starter.kill()
    starter.wait()
    deadline = time.time() + 20
    while _running(service) and time.time() < deadline:
        time.sleep(0.2)
    assert not _running(service)


def test_tls_with_the_deployment_certificates(certs):
    httpd, _ = serve("127.0.0.1", 0, admin_token=ADMIN, certfile=str(certs / "server.pem"),
                     keyfile=str(certs / "server.key"))
    address = f"127.0.0.1:{httpd.server_address[1]}"
    try:
        admin = NeighbourClient(address, retries=0, token=ADMIN, ca_file=str(certs / "ca.crt"))
        assert admin.base.startswith("https://")
        client = NeighbourClient(address, retries=0, token=admin.open_run("r", 2, 5, 3), ca_file=str(certs / "ca.crt"))
        client.submit("r", "a" * 32, np.zeros(2), [TOKEN])
        assert client.neighbours("r", "a" * 32).shape == (0, 2)
        # not signed by a CA we trust
        with pytest.raises(NeighbourServiceError, match="failed TLS verification.*CERTIFICATE_VERIFY_FAILED"):
            NeighbourClient(f"https://{address}", retries=0, token=ADMIN).open_run("x", 2, 5, 3)
        with pytest.raises(NeighbourServiceError, match="unreachable"):  # plain HTTP to the TLS port
            NeighbourClient(address, retries=0, token=ADMIN).open_run("x", 2, 5, 3)
    finally:
        httpd.shutdown()


def test_local_service_draws_its_admin_token_and_the_console_script_needs_one(monkeypatch, capsys):
    address, proc, token = start_local_service()
    try:
        assert len(token) == 64
        with pytest.raises(NeighbourServiceError, match="missing admin token"):
            NeighbourClient(address, retries=0).open_run("r", 2, 5, 3)
        assert NeighbourClient(address, retries=0, token=token).open_run("r", 2, 5, 3)
    finally:
        proc.terminate()
        proc.wait(10)
    monkeypatch.delenv("FEDREC_NB_ADMIN_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_:
        service_main(["--port", "8765"])
    assert exit_.value.code == 2 and "an admin token of at least 16 characters is required" in capsys.readouterr().err


def test_http_refusal_reaches_the_client_verbatim(service):
    _, address = service
    client = NeighbourClient(address, retries=0)
    with pytest.raises(NeighbourServiceError, match="refused /runs/ghost/submit: unknown run 'ghost'"):
        client.submit("ghost", new_handle(), np.zeros(2), ["1" * 32])
    req = urllib.request.Request(f"http://{address}/runs", data=b"[1,2]")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert json.loads(err.value.read())["error"] == "request body must be a JSON object"


def test_unreachable_service_fails_after_configured_retries():
    client = NeighbourClient("127.0.0.1:9", retries=2, backoff_s=0.01, timeout_s=1)
    with pytest.raises(NeighbourServiceError, match="unreachable after 3 attempts"):
        client.open_run("r", 2, 5, 3)


def test_restart_mid_expansion_is_an_error_not_a_half_expanded_graph():
    httpd, _ = serve("127.0.0.1", 0)
    port = httpd.server_address[1]
    client = NeighbourClient(f"127.0.0.1:{port}", retries=0)
    client.open_run("r", 2, 5, 3)
    handle = new_handle()
    client.submit("r", handle, np.zeros(2), ["1" * 32])
    httpd.shutdown()
    httpd.server_close()
    restarted, _ = serve("127.0.0.1", port)  # same address, fresh state
    try:
        with pytest.raises(NeighbourServiceError,
                           match="unknown run 'r' \\(not opened, closed, expired, or the service restarted\\)"):
            client.neighbours("r", handle)
    finally:
        restarted.shutdown()
