"""Serving the neighbour service: aiohttp's runner with the service's limits, behind the connection gate.

The limits aiohttp has settings for go through them:

- `web.Application(client_max_size=max_body_bytes)`: no body is read past this (`http_app.py`
  lowers it per route with `request.clone(client_max_size=...)`);
- `web.AppRunner` handler settings: `keepalive_timeout=idle_timeout_s` closes a connection whose
  request head has not arrived, or that idles between requests, that long; `max_headers`,
  `max_line_size`, `max_field_size` bound the request head (16 headers, 2048-byte lines);
  `read_bufsize` bounds the unread body aiohttp buffers per connection; `lingering_time` bounds
  how long the rest of a refused authenticated body is drained so its client can read the reply;
  `auto_decompress=False` keeps a compressed body from growing past what was counted;
  `logger` turns aiohttp's parse-error tracebacks into refusal lines (`refusals.ParseErrorLog`);
- `web.AppRunner(shutdown_timeout=io_timeout_s)`: at stop, a request in flight gets that long.
- `loop.create_server(ssl_handshake_timeout=, ssl_shutdown_timeout=)` (asyncio): with TLS, a
  handshake or close that the client stalls is given up after `idle_timeout_s`.

What aiohttp has no setting for is in `gate.py` (connection and request counts, per address, with
the reason there) and `http_app.py` (the body and reply deadlines). The listener is asyncio's
`loop.create_server` with `gate.GatedConnection` around aiohttp's protocol factory
(`runner.server`), so every accepted connection is counted before aiohttp serves it.
`ServiceHandle` runs all of it on its own event-loop thread for in-process use (`serve()`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import threading
import time

from aiohttp import web

from .gate import ConnectionGate, GatedConnection
from .http_app import Handlers, make_app
from .limits import Limits
from .memory import CONNECTION_BYTES
from .refusals import ParseErrorLog, RefusalLog
from .service import NeighbourService

MAX_HEADERS = 16  # aiohttp's parser limits on a request head: our clients send 6-8 short headers
MAX_HEAD_LINE = 2048  # the request line, and each header's name and value
READ_BUFSIZE = 64 << 10  # aiohttp pauses reading a connection holding 2x this of unread body
LINGER_MAX_S = 2.0  # the most a refused authenticated body is drained for (at most io_timeout_s)
BACKLOG = 512  # connections the kernel queues before they are accepted
THREAD_RESERVE_BYTES = 4 << 20  # the worker threads' stacks and states


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """Server-side TLS from the deployment's certificate (deploy/make_certs.sh: server.pem / server.key)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


@dataclasses.dataclass
class Listening:
    """A started service on the running loop: its bound port, gate and handlers, and `stop()`."""

    port: int
    gate: ConnectionGate
    handlers: Handlers
    runner: web.AppRunner
    listener: asyncio.AbstractServer
    sweeper: asyncio.Task

    async def stop(self) -> None:
        """Stop accepting, then close every connection (requests in flight get shutdown_timeout to finish)."""
        self.sweeper.cancel()
        self.listener.close()
        await self.runner.cleanup()


async def start(service: NeighbourService, host: str, port: int,
                ssl_context: ssl.SSLContext | None = None) -> Listening:
    """Listen on host:port (TLS when `ssl_context`) with the service's limits; returns once accepting."""
    lim = service.limits
    service.budget.set_fixed("connections", lim.max_connections * CONNECTION_BYTES)
    service.budget.set_fixed("threads", THREAD_RESERVE_BYTES)
    gate, refusals = ConnectionGate(lim), RefusalLog()
    app, handlers = make_app(service, gate, refusals)
    runner = web.AppRunner(
        app, handle_signals=False, shutdown_timeout=lim.io_timeout_s, access_log=None,
        logger=ParseErrorLog(refusals), keepalive_timeout=lim.idle_timeout_s,
        lingering_time=min(LINGER_MAX_S, lim.io_timeout_s), max_headers=MAX_HEADERS, max_line_size=MAX_HEAD_LINE,
        max_field_size=MAX_HEAD_LINE, read_bufsize=READ_BUFSIZE, auto_decompress=False)
    await runner.setup()
    loop = asyncio.get_running_loop()
    tls = {"ssl_handshake_timeout": lim.idle_timeout_s, "ssl_shutdown_timeout": lim.idle_timeout_s}
    try:
        listener = await loop.create_server(lambda: GatedConnection(gate, runner.server, refusals), host, port,
                                            ssl=ssl_context, backlog=BACKLOG, **(tls if ssl_context else {}))
    except BaseException:
        await runner.cleanup()
        raise

    async def sweep():  # abandoned runs are freed even when no request comes
        while True:
            await asyncio.sleep(max(1.0, min(60.0, lim.run_ttl_s / 4)))
            await asyncio.to_thread(service.expire)

    sweeper = loop.create_task(sweep())
    bound = listener.sockets[0].getsockname()[1]
    return Listening(bound, gate, handlers, runner, listener, sweeper)


class ServiceHandle:
    """An in-process service on its own event-loop thread: `server_address`, `service`, `shutdown()`."""

    def __init__(self, service: NeighbourService, host: str, port: int, ssl_context=None):
        self.service = service
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="neighbour-service", daemon=True)
        self.thread.start()
        try:
            self.listening = asyncio.run_coroutine_threadsafe(start(service, host, port, ssl_context),
                                                              self.loop).result(30)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        self.server_address = (host, self.listening.port)
        self.handlers: Handlers = self.listening.handlers
        self.gate: ConnectionGate = self.listening.gate

    def shutdown(self) -> None:
        """Stop listening, close every connection and the loop (idempotent)."""
        if self.loop.is_closed():
            return
        wait = self.service.limits.io_timeout_s + 30
        asyncio.run_coroutine_threadsafe(self.listening.stop(), self.loop).result(wait)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def server_close(self) -> None:
        """Same as shutdown (for callers written against http.server)."""
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
