"""The third-party neighbour service: matches equal item tokens, returns anonymous neighbours.

It is a separate process with its own address (`fedrec-neighbour-service --host H --port P`).
It never holds the token key: it sees, per run, random client handles, their user embeddings
and their item tokens, and answers each client with the embeddings of up to N other clients
sharing at least one token, with no handles, ids or item information. Clients reach it
directly; the recommendation server never relays these messages.

What it learns (threat model: it does not collude with the recommendation server): user
embeddings, the number of items each client submitted, and how often each token occurs (the
popularity histogram of the catalogue, without knowing which item a token is).

Hostile clients. Opening and closing a run needs the operator's admin token (given at start:
--admin-token-file or FEDREC_NB_ADMIN_TOKEN); opening returns a per-run secret that the
recommendation server hands its clients, and every submit / fetch must carry it
(`Authorization: Bearer <token>`, compared in constant time). A handle is written once per
run unless the run was opened with `updates` (trainable expansion re-submits every round).
Every size, count and wait is bounded (`Limits`): body bytes, tokens per submit, handles per
run, open runs, estimated stored bytes, idle connections, slow bodies and slow readers; an
abandoned run is forgotten after `run_ttl_s`. Every refusal is an HTTP error with a JSON body
{"error": reason}. The server is aiohttp: asynchronous, so a slow or half-open connection holds
a socket, not a thread, and its keep-alive timer closes connections that never finish a request.
`NeighbourService(admin_token=None)` (what `serve()` gives without a token) checks no
credentials at all; it exists for in-process tests, and the console script refuses to start so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import hmac
import json
import logging
import os
import secrets
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from itertools import chain

import numpy as np
from aiohttp import web

from .tokens import TOKEN_PATTERN

log = logging.getLogger("fedrec_flwr.neighbours")
HANDLE_PATTERN = TOKEN_PATTERN
ADMIN_TOKEN_ENV = "FEDREC_NB_ADMIN_TOKEN"
BYTES_PER_TOKEN = 260  # one stored token: its string, set slots, index entry (measured: <= 265 when all distinct)
BYTES_PER_ENTRY = 700  # one handle besides its tokens and embedding


class RequestError(ValueError):
    """A request the service refuses; the message says what was wrong, `status` is its HTTP code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Service-wide bounds: each caps the memory or the time one client can make the service spend."""

    max_body_bytes: int = 8 << 20
    max_tokens: int = 100_000  # per submit; a run may not be opened with more
    max_entries: int = 200_000  # handles per run
    max_runs: int = 16
    max_dim: int = 1024
    max_neighbours: int = 1000
    max_memory_bytes: int = 2 << 30  # estimated bytes stored over all runs
    run_ttl_s: float = 3600.0  # a run nobody touched for this long is forgotten
    idle_timeout_s: float = 15.0  # a connection idle (or still sending its request head) this long is closed
    io_timeout_s: float = 15.0  # the whole body must arrive, and the whole reply leave, within this
    max_inflight: int = 128  # requests served at once; more are answered 503


@dataclass
class Run:
    """One run's settings, credentials and submissions, with the inverted index token -> handles."""

    dim: int
    max_tokens: int
    max_neighbours: int
    updates: bool
    secret: str | None
    touched: float
    embeddings: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: dict[str, frozenset[str]] = field(default_factory=dict)
    index: dict[str, set[str]] = field(default_factory=dict)
    stored_bytes: int = 0


def _cost(dim: int, n_tokens: int) -> int:
    return BYTES_PER_ENTRY + 4 * dim + BYTES_PER_TOKEN * n_tokens


def _check_token(given, expected: str | None, what: str) -> None:
    """401 without a credential, 403 with a wrong one; nothing to check when `expected` is None."""
    if expected is None:
        return
    if not isinstance(given, str) or not given:
        raise RequestError(f"missing {what} (Authorization: Bearer <token>)", 401)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise RequestError(f"wrong {what}", 403)


class NeighbourService:
    """In-memory matching state of every open run (thread-safe), with its credentials and bounds."""

    def __init__(self, limits: Limits | None = None, admin_token: str | None = None, clock=time.monotonic):
        self.limits = limits or Limits()
        self.admin_token = admin_token
        self.clock = clock
        self.runs: dict[str, Run] = {}
        self.lock = threading.Lock()

    def _stored(self) -> int:
        return sum(r.stored_bytes for r in self.runs.values())

    def expire(self) -> list[str]:
        """Forget runs idle for longer than `run_ttl_s`; returns their ids."""
        with self.lock:
            return self._expire()

    def _expire(self) -> list[str]:
        now = self.clock()
        gone = [rid for rid, r in self.runs.items() if now - r.touched > self.limits.run_ttl_s]
        for rid in gone:
            del self.runs[rid]
            log.info("run %s expired after %.0fs idle", rid, self.limits.run_ttl_s)
        return gone

    def open_run(self, run_id: str, dim: int, max_tokens: int, max_neighbours: int, updates: bool = False,
                 admin_token: str | None = None) -> str:
        """Start accepting submissions for `run_id`; returns its secret (idempotent for identical settings)."""
        _check_token(admin_token, self.admin_token, "admin token")
        if not isinstance(run_id, str) or not run_id or len(run_id) > 64 or not run_id.isascii() or "/" in run_id:
            raise RequestError("run_id must be a non-empty ASCII string of at most 64 characters, without '/'")
        lim = self.limits
        for name, value, cap in (("dim", dim, lim.max_dim), ("max_tokens", max_tokens, lim.max_tokens),
                                 ("max_neighbours", max_neighbours, lim.max_neighbours)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= cap:
                raise RequestError(f"{name} must be an integer in [1, {cap}], got {value!r}")
        if not isinstance(updates, bool):
            raise RequestError(f"updates must be true or false, got {updates!r}")
        with self.lock:
            self._expire()
            existing = self.runs.get(run_id)
            if existing is not None:
                if (existing.dim, existing.max_tokens, existing.max_neighbours, existing.updates) != (
                        dim, max_tokens, max_neighbours, updates):
                    raise RequestError(f"run '{run_id}' is already open with other settings", 409)
                existing.touched = self.clock()
                return existing.secret or ""
            if len(self.runs) >= lim.max_runs:
                raise RequestError(f"too many open runs (limit {lim.max_runs})", 429)
            secret = None if self.admin_token is None else secrets.token_hex(32)
            self.runs[run_id] = Run(dim, max_tokens, max_neighbours, updates, secret, self.clock())
            return secret or ""

    def close_run(self, run_id: str, admin_token: str | None = None) -> None:
        """Forget everything about a run (the recommendation server calls this when its run ends)."""
        _check_token(admin_token, self.admin_token, "admin token")
        with self.lock:
            if self.runs.pop(run_id, None) is None:
                raise RequestError(f"unknown run '{run_id[:64]}'", 404)

    def _run(self, run_id: str, secret) -> Run:
        self._expire()
        run = self.runs.get(run_id)
        if run is None:
            raise RequestError(f"unknown run '{run_id[:64]}' (not opened, closed, expired, or the service restarted)", 404)
        _check_token(secret, run.secret, "run secret")
        run.touched = self.clock()
        return run

    def submit(self, run_id: str, handle: str, embedding: list, tokens: list, secret: str | None = None) -> None:
        """Store one client's embedding and item tokens; a handle is written once unless the run allows updates."""
        with self.lock:
            run = self._run(run_id, secret)
            if not isinstance(handle, str) or not HANDLE_PATTERN.match(handle):
                raise RequestError("handle must be 32 lowercase hex characters")
            if not isinstance(tokens, list) or not tokens:
                raise RequestError("tokens must be a non-empty list")
            if len(tokens) > run.max_tokens:
                raise RequestError(f"too many tokens: {len(tokens)} > limit {run.max_tokens}", 413)
            bad = next((t for t in tokens if not isinstance(t, str) or not TOKEN_PATTERN.match(t)), None)
            if bad is not None:
                raise RequestError(f"malformed token {str(bad)[:40]!r}: expected 32 lowercase hex characters")
            if not isinstance(embedding, list) or len(embedding) != run.dim or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in embedding):
                raise RequestError(f"embedding must be {run.dim} finite numbers")
            try:
                emb = np.asarray(embedding, dtype=np.float32)
            except OverflowError:
                emb = np.full(run.dim, np.inf, np.float32)
            if not np.isfinite(emb).all():
                raise RequestError(f"embedding must be {run.dim} finite numbers")
            toks = frozenset(tokens)
            old = run.tokens.get(handle)
            if old is not None:
                if old == toks and np.array_equal(run.embeddings[handle], emb):
                    return  # the same submission again (a retry after a lost reply): already stored
                if not run.updates:
                    raise RequestError("this handle has already submitted to this run", 409)
            elif len(run.tokens) >= self.limits.max_entries:
                raise RequestError(f"run is full ({self.limits.max_entries} handles)", 429)
            cost = _cost(run.dim, len(toks)) - (_cost(run.dim, len(old)) if old is not None else 0)
            if self._stored() + cost > self.limits.max_memory_bytes:
                raise RequestError(f"service storage budget ({self.limits.max_memory_bytes} bytes) exhausted", 429)
            for t in old or ():  # an update replaces the old entry
                run.index[t].discard(handle)
                if not run.index[t]:
                    del run.index[t]
            run.embeddings[handle], run.tokens[handle] = emb, toks
            for t in toks:
                run.index.setdefault(t, set()).add(handle)
            run.stored_bytes += cost

    def neighbours(self, run_id: str, handle: str, secret: str | None = None) -> np.ndarray:
        """Embeddings [<= N, dim] of other clients sharing >= 1 token, most shared tokens first."""
        with self.lock:
            run = self._run(run_id, secret)
            if not isinstance(handle, str) or handle not in run.tokens:
                raise RequestError("this handle has not submitted to this run", 404)
            shared = Counter(chain.from_iterable(run.index[t] for t in run.tokens[handle]))
            del shared[handle]
            chosen = heapq.nsmallest(run.max_neighbours, shared.items(), key=lambda hc: (-hc[1], hc[0]))
            if not chosen:
                return np.zeros((0, run.dim), np.float32)
            return np.stack([run.embeddings[h] for h, _ in chosen])


# -- HTTP ---------------------------------------------------------------------------------
def _json(status: int, body: dict) -> web.Response:
    resp = web.json_response(body, status=status)
    if status >= 400:
        resp.force_close()  # after a refusal nothing more is read from this connection
    return resp


class _Protocol(web.RequestHandler):
    """aiohttp's connection handler, answering what its HTTP parser refuses with a JSON body too."""

    def handle_error(self, request, status: int = 500, exc=None, message=None):
        """aiohttp's hook for requests it could not parse (or a crash): the first line of its reason as JSON."""
        reason = (message or HTTPStatus(status).phrase).splitlines()[0].rstrip(":")
        log.debug("protocol error %d: %s", status, reason)
        return _json(status, {"error": reason})


class _Server(web.Server):
    def __call__(self):  # one _Protocol per connection
        return _Protocol(self, loop=self._loop, **self._kwargs)


def _bearer(request) -> str | None:
    value = request.headers.get("Authorization", "")
    return value[7:].strip() if value.startswith("Bearer ") else None


class _App:
    """Routes requests to a NeighbourService; every outcome is a JSON reply."""

    def __init__(self, service: NeighbourService):
        self.service, self.limits, self.inflight = service, service.limits, 0

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.inflight >= self.limits.max_inflight:
            return _json(503, {"error": f"service busy ({self.limits.max_inflight} requests in flight), retry later"})
        self.inflight += 1  # until the reply has left: a slow reader's reply counts too
        try:
            try:
                status, body = await self._dispatch(request)
            except RequestError as exc:
                status, body = exc.status, {"error": str(exc)}
            except Exception:  # a bug must still answer, not drop the connection
                log.exception("internal error on %s %s", request.method, request.path)
                status, body = 500, {"error": "internal error"}
            resp = _json(status, body)
            try:  # a reader that does not read its reply is cut off, not waited for
                async with asyncio.timeout(self.limits.io_timeout_s):
                    await resp.prepare(request)
                    await resp.write_eof()
            except TimeoutError:
                if request.transport is not None:
                    request.transport.abort()
            return resp
        finally:
            self.inflight -= 1

    async def _body(self, request) -> dict:
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise RequestError(f"request body over {limit} bytes", 413)
        buf = bytearray()
        if request.headers.get("Expect", "").lower() == "100-continue":  # curl asks before bodies over 1 KiB
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            async with asyncio.timeout(self.limits.io_timeout_s):
                while chunk := await request.content.read(1 << 16):
                    buf += chunk
                    if len(buf) > limit:
                        raise RequestError(f"request body over {limit} bytes", 413)
        except TimeoutError:
            raise RequestError(f"request body not received within {self.limits.io_timeout_s:g}s", 408) from None
        try:
            body = json.loads(buf or b"null")
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise RequestError("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    async def _dispatch(self, request) -> tuple[int, dict]:
        parts = request.path.strip("/").split("/")
        if parts == ["health"]:
            if request.method != "GET":
                raise RequestError(f"{request.method} not allowed on /health", 405)
            return 200, {"status": "ok"}
        known = parts == ["runs"] or (len(parts) == 3 and parts[0] == "runs" and parts[2] in ("submit", "neighbours", "close"))
        if not known:
            raise RequestError(f"no such endpoint {request.path[:100]}", 404)
        if request.method != "POST":
            raise RequestError(f"{request.method} not allowed on {request.path[:100]}; use POST", 405)
        body, token, svc = await self._body(request), _bearer(request), self.service
        if parts == ["runs"]:
            secret = await asyncio.to_thread(svc.open_run, body.get("run_id"), body.get("dim"), body.get("max_tokens"),
                                             body.get("max_neighbours"), body.get("updates", False), token)
            return 200, {"status": "open", "secret": secret}
        run_id, action = parts[1], parts[2]
        if action == "close":
            await asyncio.to_thread(svc.close_run, run_id, token)
            return 200, {"status": "closed"}
        if action == "submit":
            await asyncio.to_thread(svc.submit, run_id, body.get("handle"), body.get("embedding"), body.get("tokens"), token)
            return 200, {"status": "stored"}
        emb = await asyncio.to_thread(svc.neighbours, run_id, body.get("handle"), token)
        return 200, {"embeddings": emb.tolist(), "dim": emb.shape[1]}


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """Server-side TLS from the deployment's certificate (deploy/make_certs.sh: server.pem / server.key)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


async def start(service: NeighbourService, host: str, port: int, ssl_context: ssl.SSLContext | None = None):
    """Listen on host:port (TLS when `ssl_context`); returns (async stop(), bound port) once accepting."""
    lim = service.limits
    server = _Server(_App(service), keepalive_timeout=lim.idle_timeout_s, lingering_time=min(2.0, lim.io_timeout_s),
                     auto_decompress=False, access_log=None)
    runner = web.ServerRunner(server, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, backlog=512)
    await site.start()

    async def sweep():  # abandoned runs are freed even when no request comes
        while True:
            await asyncio.sleep(max(1.0, min(60.0, lim.run_ttl_s / 4)))
            service.expire()

    sweeper = asyncio.get_running_loop().create_task(sweep())

    async def stop():
        sweeper.cancel()
        await runner.cleanup()

    return stop, runner.addresses[0][1]


class ServiceHandle:
    """An in-process service on its own event-loop thread: `server_address`, `service`, `shutdown()`."""

    def __init__(self, service: NeighbourService, host: str, port: int, ssl_context=None):
        self.service = service
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="neighbour-service", daemon=True)
        self.thread.start()
        try:
            self._stop, bound = asyncio.run_coroutine_threadsafe(start(service, host, port, ssl_context), self.loop).result(30)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        self.server_address = (host, bound)

    def shutdown(self) -> None:
        """Stop listening, close every connection and the loop (idempotent)."""
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def server_close(self) -> None:
        """Same as shutdown (kept for callers written against http.server)."""
        self.shutdown()


def serve(host: str = "127.0.0.1", port: int = 0, max_body: int | None = None, *, admin_token: str | None = None,
          limits: Limits | None = None, certfile: str | None = None, keyfile: str | None = None,
          clock=time.monotonic) -> tuple[ServiceHandle, threading.Thread]:
    """Start the service in a background thread; returns (handle, thread), the port in handle.server_address.

    Without `admin_token` no credential is checked (in-process tests); the console script always has one.
    """
    limits = limits or Limits()
    if max_body is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body)
    ctx = tls_context(certfile, keyfile) if certfile else None
    handle = ServiceHandle(NeighbourService(limits, admin_token, clock), host, port, ctx)
    return handle, handle.thread


def _read_admin_token(path: str | None) -> str:
    token = open(path, encoding="utf-8").read().strip() if path else os.environ.get(ADMIN_TOKEN_ENV, "").strip()
    if len(token) < 16:
        raise ValueError(f"an admin token of at least 16 characters is required: --admin-token-file FILE or "
                         f"${ADMIN_TOKEN_ENV}")
    return token


def main(argv: list[str] | None = None) -> None:
    """Console script: fedrec-neighbour-service --host 0.0.0.0 --port 8765 --admin-token-file F [--certfile --keyfile]"""
    ap = argparse.ArgumentParser(description="FedGNN third-party neighbour service")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--admin-token-file", help=f"file holding the operator token (else ${ADMIN_TOKEN_ENV})")
    ap.add_argument("--certfile", help="TLS certificate (PEM); with --keyfile the service speaks HTTPS only")
    ap.add_argument("--keyfile", help="TLS private key (PEM)")
    for f in dataclasses.fields(Limits):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, metavar="N")
    args = ap.parse_args(argv)
    if bool(args.certfile) != bool(args.keyfile):
        ap.error("--certfile and --keyfile go together")
    try:
        token = _read_admin_token(args.admin_token_file)
    except (OSError, ValueError) as exc:
        ap.error(str(exc))
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    logging.basicConfig(level=logging.INFO)
    ctx = tls_context(args.certfile, args.keyfile) if args.certfile else None

    async def run_forever():
        _, port = await start(NeighbourService(limits, token), args.host, args.port, ctx)
        log.info("neighbour service listening on %s://%s:%d", "https" if ctx else "http", args.host, port)
        await asyncio.Event().wait()

    try:
        asyncio.run(run_forever())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
