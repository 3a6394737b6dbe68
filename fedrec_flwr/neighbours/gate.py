"""Connection and in-flight request limits, in all and per client address: what aiohttp has no setting for.

aiohttp bounds a connection's time (`keepalive_timeout`) and its request head (`max_line_size`,
`max_field_size`, `max_headers`), which the service sets (`server.py`), but not how many
connections are held, nor how many one client address holds. Counting in a middleware or an
`on_request_start` signal would come too late: a half-open connection (connected, sending
nothing) never reaches either, and holding many of them is the cheapest way to starve a server.
So the count is made where a connection is accepted, with public API only: the listener is
`loop.create_server` (asyncio) with `GatedConnection` as its protocol factory, which asks the gate
first and then hands the connection to aiohttp's own protocol (`runner.server()`, aiohttp's
documented protocol factory for `create_server`) by composition. A connection over a limit is
answered 503 with a one-line JSON body and closed before aiohttp sees it.

An address at its connection limit (or the service at its total) does not lock others of that
address out: a new connection displaces the address's longest-idle one (half-open, still sending
its head, or kept alive between requests) once that has idled `evict_after_s`; only when none has
is the new one refused. A connection whose request is being served is never displaced (the app's
middleware marks it busy while it is). With `exempt_loopback` the per-address limits skip
loopback clients: they run on the service's own machine (a simulation's devices), where strangers
and honest clients share one address and a per-address cap could not tell them apart; the totals
still apply to them. Authenticated requests in flight are counted the same way (`start_request`),
in all and per address. Everything here runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import time
from http import HTTPStatus

from .limits import Limits


def address_key(peername) -> str:
    """The client address that per-address limits count: the IP (IPv4-mapped IPv6 as IPv4), an IPv6 client's /64."""
    host = peername[0] if isinstance(peername, (tuple, list)) and peername else str(peername)
    try:
        ip = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return str(host)
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


@functools.lru_cache(maxsize=1024)
def is_loopback(key: str) -> bool:
    """Whether an address key is a loopback address (the clients `exempt_loopback` lets past per-address limits)."""
    try:
        return ipaddress.ip_address(key).is_loopback
    except ValueError:
        return False


def raw_reply(status: int, reason: str) -> bytes:
    """A whole HTTP reply with a JSON error body, written before any request was read (a connection refused)."""
    body = json.dumps({"error": reason}).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % (status, HTTPStatus(status).phrase.encode(), len(body))) + body


class ConnectionGate:
    """Connections (keyed by their transport) and in-flight requests, counted in all and per client address."""

    def __init__(self, limits: Limits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.evict_after_s = min(1.0, limits.idle_timeout_s / 2)
        self.connections: dict[str, int] = {}
        self.inflight: dict[str, int] = {}
        self.idle: dict[str, dict[object, float]] = {}  # address -> {transport: idle since}, oldest first
        self.member: dict[object, str] = {}  # transport -> its address
        self.total_connections = 0
        self.total_inflight = 0
        self.displaced = 0

    def admit(self, key: str, conn) -> str | None:
        """Count a new connection; the reason to refuse it instead, if over a limit with none to displace."""
        lim = self.limits
        if self.total_connections >= lim.max_connections and not self._displace(
                max(self.connections, key=self.connections.get)):
            return f"service busy ({lim.max_connections} connections held), retry later"
        if (self.connections.get(key, 0) >= lim.max_connections_per_address and not self._exempt(key)
                and not self._displace(key)):
            return f"too many connections from your address ({lim.max_connections_per_address}), retry later"
        self.total_connections += 1
        self.connections[key] = self.connections.get(key, 0) + 1
        self.member[conn] = key
        self.idle.setdefault(key, {})[conn] = self.clock()
        return None

    def key_of(self, conn) -> str:
        """The address key a counted connection was admitted under ("?" for one the gate does not know)."""
        return self.member.get(conn, "?")

    def _exempt(self, key: str) -> bool:
        return bool(self.limits.exempt_loopback) and is_loopback(key)

    def _displace(self, key: str) -> bool:
        idle = self.idle.get(key)
        if not idle:
            return False
        conn, since = next(iter(idle.items()))  # the longest idle
        if self.clock() - since < self.evict_after_s:
            return False
        self.leave(conn)
        self.displaced += 1
        conn.abort()  # at once: a TLS close would wait for the stranger's close_notify
        return True

    def leave(self, conn) -> None:
        """Uncount a closed connection (again: nothing)."""
        key = self.member.pop(conn, None)
        if key is None:
            return
        self.total_connections -= 1
        if self.connections[key] <= 1:
            del self.connections[key]
        else:
            self.connections[key] -= 1
        idle = self.idle.get(key)
        if idle is not None:
            idle.pop(conn, None)
            if not idle:
                del self.idle[key]

    def busy(self, conn) -> None:
        """A request on this connection is being handled: it cannot be displaced meanwhile."""
        key = self.member.get(conn)
        if key is not None:
            self.idle.get(key, {}).pop(conn, None)

    def rest(self, conn) -> None:
        """Its request is done: the connection idles (kept alive) from now on."""
        key = self.member.get(conn)
        if key is not None:
            self.idle.setdefault(key, {})[conn] = self.clock()

    def start_request(self, key: str) -> str | None:
        """Count an authenticated request being served; the reason to refuse it instead, if over a limit."""
        lim = self.limits
        if self.total_inflight >= lim.max_inflight:
            return f"service busy ({lim.max_inflight} requests in flight), retry later"
        if self.inflight.get(key, 0) >= lim.max_inflight_per_address and not self._exempt(key):
            return f"too many requests in flight from your address ({lim.max_inflight_per_address}), retry later"
        self.total_inflight += 1
        self.inflight[key] = self.inflight.get(key, 0) + 1
        return None

    def end_request(self, key: str) -> None:
        """Uncount a finished request."""
        self.total_inflight -= 1
        if self.inflight[key] <= 1:
            del self.inflight[key]
        else:
            self.inflight[key] -= 1


class GatedConnection(asyncio.Protocol):
    """One accepted connection: admitted by the gate, then served by aiohttp's protocol, or refused with a 503.

    Delegates every protocol callback to the protocol `factory()` makes (aiohttp's, made only once
    the connection is admitted); the transport stays aiohttp's to read and write.
    """

    def __init__(self, gate: ConnectionGate, factory, refusals):
        self.gate, self.factory, self.refusals = gate, factory, refusals
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        """Count the connection against its address; refuse it at once (503, closed) when over a limit."""
        self.transport = transport
        key = address_key(transport.get_extra_info("peername"))
        reason = self.gate.admit(key, transport)
        if reason is not None:
            self.refusals.note(key, "connection", 503, reason)
            transport.write(raw_reply(503, reason))
            transport.close()
            return
        self.inner = self.factory()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        """Hand received bytes to aiohttp (a refused connection's are dropped)."""
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self):
        """The client closed its side: aiohttp decides whether the transport closes too."""
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        """Flow control from the transport, for aiohttp's writer."""
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        """Flow control from the transport, for aiohttp's writer."""
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        """Uncount the connection, then let aiohttp clean up."""
        self.gate.leave(self.transport)
        if self.inner is not None:
            self.inner.connection_lost(exc)
