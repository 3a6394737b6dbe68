"""The neighbour service's HTTP API: an aiohttp `web.Application` over a `NeighbourService`.

    GET  /health                       no credential; takes no request slot
    GET  /stats                        admin token: the memory accounting
    POST /runs                         admin token: open a run, returns its secret
    POST /runs/{run_id}/close          admin token: forget the run
    POST /runs/{run_id}/submit         run secret: store a handle's embedding and item tokens
    POST /runs/{run_id}/neighbours     run secret: the handle's neighbours' embeddings

Every reply is JSON; a refusal is `{"error": reason}` with its HTTP status (a request head aiohttp
cannot parse gets aiohttp's own plain-text 400, logged as one refusal line by
`refusals.ParseErrorLog`). Order of checks, so that a stranger costs next to nothing:

1. The credential (`Authorization: Bearer <token>`) is checked from the request head. Without the
   right one the request is answered 401 / 403 (404 for an unknown run or endpoint, 405 for a
   wrong method) at once, its body is never read nor a `100 Continue` sent, and its connection
   is closed.
2. The request takes a slot (`gate.ConnectionGate.start_request`: in all and per address), or is
   answered 503.
3. The body's size: at most the route's (a submit: what the run's `max_tokens` and `dim` need, at
   most `max_body_bytes`; other routes `SMALL_BODY_BYTES`), refused 413 from its Content-Length
   when declared, else counted while it is read (aiohttp's `client_max_size`). The working memory
   it can take is reserved from the request pool (`memory.MemoryBudget`), or 503 / 413.
4. Only now `100 Continue` is sent if asked for, and the body read, within `io_timeout_s` (408);
   aiohttp has no per-request body deadline, so this one is an `asyncio.timeout`. So is the
   reply's: a reader that does not read is cut off, not waited for.

The routes' expect handler sends nothing: aiohttp's default would send `100 Continue` before any
middleware or handler could check the credential.
"""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
from aiohttp import HttpVersion11, web

from .gate import ConnectionGate
from .limits import RequestError
from .memory import PARSE_FACTOR, PARSE_FIXED
from .refusals import RefusalLog
from .runs import Run
from .service import NeighbourService

log = logging.getLogger("fedrec_flwr.neighbours")
SMALL_BODY_BYTES = 4096  # open / close / fetch bodies hold a few short fields
SUBMIT_BYTES_FIXED = 1024  # a submit body: braces, keys, the handle
SUBMIT_BYTES_PER_TOKEN = 40  # '"<32 hex>", '
SUBMIT_BYTES_PER_VALUE = 32  # a float64 repr is at most 24 characters, plus ', '
MAX_CONTAINERS = 8  # JSON arrays + objects in one body (a submit has 3): bounds what parsing can allocate
WHOLE_REPLY_BYTES = 1 << 20  # a neighbours reply up to this is sent whole, a larger one streamed in chunks
STREAM_CHUNK_BYTES = 64 << 10  # the rows of one chunk of a streamed reply
RUN_ACTIONS = ("submit", "neighbours", "close")
MEMBER_ACTIONS = ("submit", "neighbours")  # what a run secret allows; the rest needs the admin token


def submit_body_limit(run: Run, max_body: int) -> int:
    """The largest submit body an honest client of this run sends (max_tokens tokens, dim floats)."""
    return min(max_body, SUBMIT_BYTES_FIXED + SUBMIT_BYTES_PER_TOKEN * run.max_tokens
               + SUBMIT_BYTES_PER_VALUE * run.dim)


def json_reply(status: int, body: dict) -> web.Response:
    """A JSON reply; after a refusal (status >= 400) the connection is not kept alive."""
    resp = web.json_response(body, status=status)
    if status >= 400:
        resp.force_close()
    return resp


def bearer(request: web.BaseRequest) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    value = request.headers.get("Authorization", "")
    return value[7:].strip() if value.startswith("Bearer ") else None


def unknown_endpoint(method: str, path: str) -> RequestError:
    """The refusal of a request no route takes: 405 naming the method to use on a known path, else 404."""
    parts = path.strip("/").split("/")
    allowed = None
    if parts in (["health"], ["stats"]):
        allowed, path = "GET", "/" + parts[0]
    elif parts == ["runs"] or (len(parts) == 3 and parts[0] == "runs" and parts[2] in RUN_ACTIONS):
        allowed = "POST"
    if allowed is None or method == allowed:
        return RequestError(f"no such endpoint {path[:100]}", 404)
    return RequestError(f"{method[:20]} not allowed on {path[:100]}; use {allowed}", 405)


def parse_body(raw: bytes) -> dict:
    """One flat JSON object (lists of plain values allowed): what every endpoint takes."""
    if raw.count(b"[") + raw.count(b"{") > MAX_CONTAINERS:
        raise RequestError(f"request body must be one JSON object of plain values and lists "
                           f"(at most {MAX_CONTAINERS} arrays and objects in all)")
    try:
        body = json.loads(raw or b"null")
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise RequestError("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _rows_json(emb: np.ndarray) -> str:
    return ", ".join(json.dumps(row) for row in emb.tolist())


async def _no_early_continue(request: web.Request) -> None:
    """The routes' expect handler: `100 Continue` is sent by the handler once the credential and size pass."""
    return None


def make_app(service: NeighbourService, gate: ConnectionGate,
             refusals: RefusalLog) -> tuple[web.Application, Handlers]:
    """The aiohttp application serving `service`, and its handlers (which count the bodies they read)."""
    handlers = Handlers(service, gate, refusals)

    @web.middleware
    async def mark_busy(request: web.Request, handler) -> web.StreamResponse:
        """A connection whose request is being served is not displaced by the gate until it is answered."""
        conn = request.transport
        gate.busy(conn)
        try:
            return await handler(request)
        finally:
            gate.rest(conn)

    app = web.Application(client_max_size=service.limits.max_body_bytes, middlewares=[mark_busy])
    for method, path, handler in (("GET", "/health", handlers.health), ("GET", "/stats", handlers.stats),
                                  ("POST", "/runs", handlers.open_run),
                                  ("POST", "/runs/{run_id}/{action:submit|neighbours|close}", handlers.run_action),
                                  ("*", "/{path:.*}", handlers.unknown)):
        app.router.add_route(method, path, handler, expect_handler=_no_early_continue)
    return app, handlers


class Handlers:
    """The route handlers: credentials from the head, then limits, then the body (see the module docstring)."""

    def __init__(self, service: NeighbourService, gate: ConnectionGate, refusals: RefusalLog):
        self.service, self.limits, self.gate, self.refusals = service, service.limits, gate, refusals
        self.body_reads = 0  # bodies these handlers have started to read (tests check that refusals read none)

    # -- routes ---------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.StreamResponse:
        """GET /health: 200 without a credential or a request slot (a body sent with it closes the connection)."""
        return await self._send(request, json_reply(200, {"status": "ok"}), close=request.body_exists)

    async def stats(self, request: web.Request) -> web.StreamResponse:
        """GET /stats: the operator's view of the memory accounting."""
        return await self._authenticated(request, "stats", None)

    async def open_run(self, request: web.Request) -> web.StreamResponse:
        """POST /runs: the operator opens a run."""
        return await self._authenticated(request, "open", None)

    async def run_action(self, request: web.Request) -> web.StreamResponse:
        """POST /runs/{run_id}/{submit|neighbours|close}."""
        return await self._authenticated(request, request.match_info["action"], request.match_info["run_id"])

    async def unknown(self, request: web.Request) -> web.StreamResponse:
        """Any other method or path: 404 / 405, answered from the head with the connection closed."""
        exc = unknown_endpoint(request.method, request.path)
        return await self._refuse(request, self.gate.key_of(request.transport), exc, close=True)

    # -- the checks -------------------------------------------------------------------------
    async def _authenticated(self, request: web.Request, kind: str, run_id: str | None) -> web.StreamResponse:
        peer = self.gate.key_of(request.transport)
        action = "member" if kind in MEMBER_ACTIONS else "admin"
        try:
            run = self.service.authorize(action, run_id, bearer(request))
        except RequestError as exc:  # not authenticated: answered now, body unread, connection closed
            return await self._refuse(request, peer, exc, close=True)
        reason = self.gate.start_request(peer)
        if reason is not None:
            return await self._refuse(request, peer, RequestError(reason, 503))
        try:
            return await self._serve(request, kind, run_id, run)
        except RequestError as exc:
            return await self._refuse(request, peer, exc)
        except Exception:  # a bug must still answer, not drop the connection
            log.exception("internal error on %s %s", request.method, request.path[:120])
            return await self._send(request, json_reply(500, {"error": "internal error"}))
        finally:
            self.gate.end_request(peer)

    def _body_limit(self, kind: str, run: Run | None) -> int:
        if kind == "submit" and run is not None:
            return submit_body_limit(run, self.limits.max_body_bytes)
        return min(self.limits.max_body_bytes, SMALL_BODY_BYTES)

    async def _serve(self, request: web.Request, kind: str, run_id: str | None, run: Run | None) -> web.StreamResponse:
        limit = self._body_limit(kind, run)
        declared = request.content_length
        if declared is not None and declared > limit:
            raise RequestError(f"request body over {limit} bytes", 413)
        need = PARSE_FACTOR * (declared if declared is not None else limit) + PARSE_FIXED
        if kind == "neighbours" and run is not None:
            values = run.max_neighbours * run.dim
            need += 4 * values + 2 * min(SUBMIT_BYTES_PER_VALUE * values + 64, WHOLE_REPLY_BYTES) + (64 << 10)
        budget = self.service.budget
        if need > budget.request_capacity:
            raise RequestError(f"this request needs {need} bytes of working memory, more than the service's "
                               f"request pool ({budget.request_capacity} bytes)", 413)
        if not budget.acquire_request(need):
            raise RequestError("service busy (request memory in use), retry later", 503)
        try:
            body = await self._read(request, limit)
            svc, token = self.service, bearer(request)
            if kind == "neighbours":
                return await self._send_neighbours(request, run_id, body, token)
            if kind == "stats":
                return await self._send(request, json_reply(200, await asyncio.to_thread(svc.stats, token)))
            status, out = await asyncio.to_thread(self._call, kind, run_id, body, token)
            return await self._send(request, json_reply(status, out))
        finally:
            budget.release_request(need)

    async def _read(self, request: web.Request, limit: int) -> bytes:
        """The body, at most `limit` bytes (aiohttp's client_max_size counts them), within io_timeout_s."""
        self.body_reads += 1
        transport = request.transport
        if (request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue"
                and transport is not None):  # curl asks before bodies over 1 KiB
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            async with asyncio.timeout(self.limits.io_timeout_s):
                return await request.clone(client_max_size=limit).read()
        except TimeoutError:
            raise RequestError(f"request body not received within {self.limits.io_timeout_s:g}s", 408) from None
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"request body over {limit} bytes", 413) from None
        except web.RequestPayloadError as exc:
            raise RequestError(f"request body is malformed: {str(exc)[:100]}") from None
        except ConnectionError:
            raise RequestError("connection lost while the request body was read") from None

    def _call(self, kind: str, run_id: str | None, raw: bytes, token) -> tuple[int, dict]:
        """Parse and run one open / close / submit (on a worker thread: large bodies do not block the loop)."""
        body, svc = parse_body(raw), self.service
        if kind == "open":
            secret = svc.open_run(body.get("run_id"), body.get("dim"), body.get("max_tokens"),
                                  body.get("max_neighbours"), body.get("updates", False), token,
                                  body.get("memory_bytes"), body.get("match", "shared_items"))
            run = svc.runs.get(body.get("run_id"))
            return 200, {"status": "open", "secret": secret, "memory_bytes": run.budget if run else None}
        if kind == "close":
            svc.close_run(run_id, token)
            return 200, {"status": "closed"}
        svc.submit(run_id, body.get("handle"), body.get("embedding"), body.get("tokens"), token)
        return 200, {"status": "stored"}

    # -- replies ---------------------------------------------------------------------------
    async def _send_neighbours(self, request: web.Request, run_id: str, raw: bytes, token) -> web.StreamResponse:
        """The reply {"embeddings": [...], "dim": d}: whole when small, else streamed in chunks of rows."""
        emb = await asyncio.to_thread(lambda: self.service.neighbours(run_id, parse_body(raw).get("handle"), token))
        n, dim = emb.shape
        if n * dim * SUBMIT_BYTES_PER_VALUE <= WHOLE_REPLY_BYTES:
            return await self._send(request, json_reply(200, {"embeddings": emb.tolist(), "dim": dim}))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json; charset=utf-8"})
        resp.enable_chunked_encoding()
        rows = max(1, STREAM_CHUNK_BYTES // (SUBMIT_BYTES_PER_VALUE * dim))

        async def write():
            await resp.prepare(request)
            await resp.write(b'{"embeddings": [')
            for start in range(0, n, rows):
                text = await asyncio.to_thread(_rows_json, emb[start:start + rows])
                await resp.write(((", " if start else "") + text).encode())
            await resp.write(b'], "dim": %d}' % dim)
            await resp.write_eof()

        return await self._send(request, resp, write=write)

    async def _refuse(self, request: web.Request, peer: str, exc: RequestError, close: bool = False):
        """Answer a refusal as {"error": reason} and log it (one line, rate limited)."""
        self.refusals.note(peer, f"{request.method} {request.path}", exc.status, str(exc))
        return await self._send(request, json_reply(exc.status, {"error": str(exc)}), close=close)

    async def _send(self, request: web.Request, resp: web.StreamResponse, close: bool = False,
                    write=None) -> web.StreamResponse:
        """Write a reply within io_timeout_s (a reader that does not read is cut off, not waited for).

        `close`: then close the connection at once, without reading what is left of the body (aiohttp
        would otherwise linger to read it): what an unauthenticated request gets.
        """
        try:
            async with asyncio.timeout(self.limits.io_timeout_s):
                if write is not None:
                    await write()
                else:
                    await resp.prepare(request)
                    await resp.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
        except ConnectionError:
            pass
        transport = request.transport
        if close and transport is not None:
            transport.close()  # the reply is flushed first
            await asyncio.sleep(0)  # aiohttp learns of the close before this handler returns, and does not linger
        return resp
