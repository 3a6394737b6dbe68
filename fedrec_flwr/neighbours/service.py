"""The third-party neighbour service: matches equal item tokens, returns anonymous neighbours.

It is a separate process with its own address (`fedrec-neighbour-service --host H --port P`).
It never holds the token key: it sees, per run, random client handles, their user embeddings
and their item tokens, and answers each client with the embeddings of up to N other clients
sharing at least one token (most shared first), with no handles, ids or item information. A run
opened with `match: random` answers with N other clients drawn at random instead: a control for
measuring what shared items add. Clients reach it directly; the recommendation server never
relays these messages.

What it learns (threat model: it does not collude with the recommendation server): user
embeddings, the number of items each client submitted, and how often each token occurs (the
popularity histogram of the catalogue, without knowing which item a token is).

Credentials, checked from the request head before any body byte is read. Opening and closing a
run (and GET /stats) needs the operator's admin token (given at start: --admin-token-file or
FEDREC_NB_ADMIN_TOKEN); opening returns a per-run secret that the recommendation server hands
its clients, and every submit / fetch must carry it (`Authorization: Bearer <token>`, compared in
constant time). A request without the right credential is answered 401 / 403 (404 for an unknown
run) as soon as its head has arrived, its body is never read (nor a `100 Continue` sent), and its
connection is closed. Only then is a body read: at most the route's size (a submit: what the run's
`max_tokens` and `dim` need, at most `max_body_bytes`), within `io_timeout_s`, else 413 / 408.

Strangers. aiohttp's keep-alive timer closes a connection whose request head has not arrived
within `idle_timeout_s`, and its parser bounds the head (16 headers, 2048-byte lines). Each
client address (an IPv6 client: its /64) may hold `max_connections_per_address` connections (of
`max_connections`) and have `max_inflight_per_address` authenticated requests served at once (of
`max_inflight`); past that a new connection displaces the address's longest-idle one, or is
answered 503 at once when none has idled a second. Loopback clients (the service's own machine, as
in a simulation) skip the per-address limits unless `--exempt-loopback 0`. /health takes no
request slot.

Memory (`memory.MemoryBudget`). `max_memory_bytes` bounds the process: its own baseline (measured
at start by the console script), a reserve per possible connection, one matching computation,
the request pool (`max_request_memory_bytes`; each request reserves what its declared body can
cost to parse before reading it) and the data pool. Each run reserves its own storage budget from
the data pool when it opens: `memory_bytes` if the operator asks, else `max_run_memory_bytes`,
else data pool / `max_runs`. A run is refused (429) once its own budget is spent, whatever the
other runs hold; opening is refused (507) when the data pool cannot give the budget. Stored bytes
are counted from the objects kept (numpy `nbytes`, `sys.getsizeof`, allocator blocks), and a
submit is refused before it is stored if its upper-bound cost does not fit.

Every refusal is an HTTP error with a one-line JSON body {"error": reason} and at most one log
line (rate limited), never a traceback. An abandoned run is forgotten after `run_ttl_s`.
`NeighbourService(admin_token=None)` (what `serve()` gives without a token) checks no
credentials at all; it exists for in-process tests, and the console script refuses to start so.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import dataclasses
import functools
import heapq
import hmac
import ipaddress
import json
import logging
import os
import secrets
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus

import numpy as np
from aiohttp import web

from .memory import (
    ARRAY_FIXED,
    ARRAY_OVERHEAD,
    CONNECTION_BYTES,
    INT_BYTES,
    PARSE_FACTOR,
    PARSE_FIXED,
    TOKEN_STR_BYTES,
    MemoryBudget,
    array_bytes,
    dict_bytes,
    list_bytes,
    ndarray_bytes,
    obj_bytes,
    process_rss_bytes,
)
from .tokens import TOKEN_PATTERN

# who a handle's neighbours are: the handles sharing the most tokens with it (the paper's expansion), or handles
# drawn at random (a control: what shared items add to neighbours at all)
MATCHES = ("shared_items", "random")
_SYSTEM_RANDOM = secrets.SystemRandom()

log = logging.getLogger("fedrec_flwr.neighbours")
HANDLE_PATTERN = TOKEN_PATTERN
ADMIN_TOKEN_ENV = "FEDREC_NB_ADMIN_TOKEN"
SMALL_BODY_BYTES = 4096  # open / close / fetch bodies hold a few short fields
SUBMIT_BYTES_FIXED = 1024  # a submit body: braces, keys, the handle
SUBMIT_BYTES_PER_TOKEN = 40  # '"<32 hex>", '
SUBMIT_BYTES_PER_VALUE = 32  # a float64 repr is at most 24 characters, plus ', '
MAX_CONTAINERS = 8  # JSON arrays + objects in one body (a submit has 3): bounds what parsing can allocate
RUN_FIXED_BYTES = 8192  # a Run object with its empty containers and secret
MATCH_CHUNK = 1 << 18  # postings counted per numpy pass while matching
WHOLE_REPLY_BYTES = 1 << 20  # a neighbours reply up to this is sent whole, a larger one streamed in chunks
THREAD_RESERVE_BYTES = 4 << 20  # the worker threads' stacks and states
MAX_HEADERS = 16  # aiohttp's parser limits on a request head: our clients send 6-8 short headers
MAX_HEAD_LINE = 2048  # the request line, and each header's name and value


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
    max_memory_bytes: int = 2 << 30  # the service's memory in all (see memory.MemoryBudget)
    run_ttl_s: float = 3600.0  # a run nobody touched for this long is forgotten
    idle_timeout_s: float = 15.0  # a connection idle (or still sending its request head) this long is closed
    io_timeout_s: float = 15.0  # the whole body must arrive, and the whole reply leave, within this
    max_inflight: int = 128  # authenticated requests served at once; more are answered 503
    max_connections: int = 512  # connections held at once, over all clients
    max_connections_per_address: int = 64  # connections one client address (IPv6: one /64) may hold
    max_inflight_per_address: int = 32  # authenticated requests one address may have served at once
    exempt_loopback: int = 1  # 1: per-address limits skip 127.0.0.0/8 and ::1 (the service's own machine); 0: apply
    max_run_memory_bytes: int = 0  # a run's storage budget when it asks for none; 0: data pool / max_runs
    max_request_memory_bytes: int = 0  # working memory of the requests being served; 0: max_memory_bytes / 8

    def check(self) -> None:
        """Raise ValueError naming the first value out of range (the CLI turns it into a usage error)."""
        for f in dataclasses.fields(self):
            value, name = getattr(self, f.name), f.name.replace("_", "-")
            if isinstance(f.default, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise ValueError(f"--{name} must be a positive number of seconds, got {value!r}")
                continue
            if f.name == "exempt_loopback":
                if value not in (0, 1) or isinstance(value, bool):
                    raise ValueError(f"--{name} must be 0 or 1, got {value!r}")
                continue
            low = 0 if f.name in ("max_inflight", "max_run_memory_bytes", "max_request_memory_bytes") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name} must be an integer >= {low}, got {value!r}")


@dataclass(eq=False)
class Run:
    """One run's settings, credentials, storage budget and submissions, with the inverted index.

    A handle has a slot (its position in `handles`, `embeddings`, `token_ids`); a token an id (its
    position in `postings`, the array of slots that submitted it). `stored_bytes` counts all of it.
    """

    dim: int
    max_tokens: int
    max_neighbours: int
    updates: bool
    secret: str | None = field(repr=False)
    touched: float
    budget: int
    memory_requested: int | None = None
    match: str = "shared_items"  # MATCHES: who a handle's neighbours are
    slot_of: dict[str, int] = field(default_factory=dict, repr=False)
    handles: list[str] = field(default_factory=list, repr=False)
    embeddings: list[np.ndarray] = field(default_factory=list, repr=False)
    token_ids: list[np.ndarray] = field(default_factory=list, repr=False)
    token_id: dict[str, int] = field(default_factory=dict, repr=False)
    postings: list[array.array] = field(default_factory=list, repr=False)
    stored_bytes: int = RUN_FIXED_BYTES

    def containers(self) -> tuple:
        """The containers whose own size grows with the run (their items are counted separately)."""
        return self.slot_of, self.handles, self.embeddings, self.token_ids, self.token_id, self.postings

    def submit_body_limit(self, max_body: int) -> int:
        """The largest submit body an honest client of this run sends (max_tokens tokens, dim floats)."""
        return min(max_body, SUBMIT_BYTES_FIXED + SUBMIT_BYTES_PER_TOKEN * self.max_tokens
                   + SUBMIT_BYTES_PER_VALUE * self.dim)


def _check_token(given, expected: str | None, what: str) -> None:
    """401 without a credential, 403 with a wrong one; nothing to check when `expected` is None."""
    if expected is None:
        return
    if not isinstance(given, str) or not given:
        raise RequestError(f"missing {what} (Authorization: Bearer <token>)", 401)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise RequestError(f"wrong {what}", 403)


def _valid_run_id(run_id) -> bool:
    return isinstance(run_id, str) and 0 < len(run_id) <= 64 and run_id.isascii() and "/" not in run_id


class NeighbourService:
    """In-memory matching state of every open run (thread-safe), with its credentials and bounds."""

    def __init__(self, limits: Limits | None = None, admin_token: str | None = None, clock=time.monotonic):
        self.limits = limits or Limits()
        self.limits.check()
        self.admin_token = admin_token
        self.clock = clock
        self.runs: dict[str, Run] = {}
        self.lock = threading.Lock()
        self.budget = MemoryBudget(self.limits.max_memory_bytes, self.limits.max_request_memory_bytes)
        lim = self.limits  # one matching computation at a time (under the lock): its arrays
        chunk = min(MATCH_CHUNK + lim.max_entries, lim.max_tokens * lim.max_entries)
        self.budget.set_fixed("matching", 40 * lim.max_entries + 4 * chunk + 8 * lim.max_neighbours * lim.max_dim)

    # -- runs ---------------------------------------------------------------------------
    def expire(self) -> list[str]:
        """Forget runs idle for longer than `run_ttl_s`; returns their ids."""
        with self.lock:
            return self._expire()

    def _expire(self) -> list[str]:
        now = self.clock()
        gone = [rid for rid, r in self.runs.items() if now - r.touched > self.limits.run_ttl_s]
        for rid in gone:
            self.budget.release_run(self.runs.pop(rid).budget)
            log.info("run %s expired after %.0fs idle", rid, self.limits.run_ttl_s)
        return gone

    def default_run_budget(self) -> int:
        """The storage budget a run gets when it asks for none (see the module docstring)."""
        return self.limits.max_run_memory_bytes or max(0, self.budget.data_pool) // self.limits.max_runs

    def open_run(self, run_id: str, dim: int, max_tokens: int, max_neighbours: int, updates: bool = False,
                 admin_token: str | None = None, memory_bytes: int | None = None, match: str = "shared_items") -> str:
        """Start accepting submissions for `run_id`; returns its secret (idempotent for identical settings).

        `memory_bytes`: the run's own storage budget, reserved now from the data pool (default:
        `default_run_budget()`); no other run can use it, and this run can use no more. `match`: one of
        MATCHES, who a handle's neighbours are.
        """
        _check_token(admin_token, self.admin_token, "admin token")
        if not _valid_run_id(run_id):
            raise RequestError("run_id must be a non-empty ASCII string of at most 64 characters, without '/'")
        lim = self.limits
        for name, value, cap in (("dim", dim, lim.max_dim), ("max_tokens", max_tokens, lim.max_tokens),
                                 ("max_neighbours", max_neighbours, lim.max_neighbours)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= cap:
                raise RequestError(f"{name} must be an integer in [1, {cap}], got {value!r}")
        if not isinstance(updates, bool):
            raise RequestError(f"updates must be true or false, got {updates!r}")
        if not isinstance(match, str) or match not in MATCHES:
            raise RequestError(f"match must be one of {list(MATCHES)}, got {str(match)[:40]!r}")
        pool = self.budget.data_pool
        if memory_bytes is not None and (not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool)
                                         or not RUN_FIXED_BYTES <= memory_bytes <= max(RUN_FIXED_BYTES, pool)):
            raise RequestError(f"memory_bytes must be an integer in [{RUN_FIXED_BYTES}, {pool}], got {memory_bytes!r}")
        with self.lock:
            self._expire()
            existing = self.runs.get(run_id)
            if existing is not None:
                if (existing.dim, existing.max_tokens, existing.max_neighbours, existing.updates, existing.match) != (
                        dim, max_tokens, max_neighbours, updates, match) or memory_bytes not in (None, existing.memory_requested):
                    raise RequestError(f"run '{run_id}' is already open with other settings", 409)
                existing.touched = self.clock()
                return existing.secret or ""
            if len(self.runs) >= lim.max_runs:
                raise RequestError(f"too many open runs (limit {lim.max_runs})", 429)
            budget = memory_bytes if memory_bytes is not None else self.default_run_budget()
            if budget < RUN_FIXED_BYTES or not self.budget.reserve_run(budget):
                raise RequestError(
                    f"cannot reserve {budget} bytes of storage for run '{run_id}': the data pool has "
                    f"{max(0, pool - self.budget.run_reserved)} of {pool} bytes unreserved", 507)
            secret = None if self.admin_token is None else secrets.token_hex(32)
            self.runs[run_id] = Run(dim, max_tokens, max_neighbours, updates, secret, self.clock(), budget, memory_bytes,
                                    match)
            return secret or ""

    def close_run(self, run_id: str, admin_token: str | None = None) -> None:
        """Forget everything about a run (the recommendation server calls this when its run ends)."""
        _check_token(admin_token, self.admin_token, "admin token")
        with self.lock:
            run = self.runs.pop(run_id, None) if isinstance(run_id, str) else None
            if run is None:
                raise RequestError(f"unknown run '{str(run_id)[:64]}'", 404)
            self.budget.release_run(run.budget)

    def authorize(self, action: str, run_id: str | None, token) -> Run | None:
        """Check a request's credential from its head alone, before its body is read.

        `action` is "admin" (open, close, stats) or "member" (submit, fetch of `run_id`). Takes no
        lock, so a worker holding it for a large computation cannot stall the event loop here.
        """
        if action == "admin":
            _check_token(token, self.admin_token, "admin token")
            return None
        run = self.runs.get(run_id) if _valid_run_id(run_id) else None
        if run is None:
            raise RequestError(f"unknown run '{str(run_id)[:64]}' (not opened, closed, expired, or the service "
                               "restarted)", 404)
        _check_token(token, run.secret, "run secret")
        return run

    def _run(self, run_id: str, secret) -> Run:
        self._expire()
        run = self.runs.get(run_id) if isinstance(run_id, str) else None
        if run is None:
            raise RequestError(f"unknown run '{str(run_id)[:64]}' (not opened, closed, expired, or the service restarted)", 404)
        _check_token(secret, run.secret, "run secret")
        run.touched = self.clock()
        return run

    # -- submit -------------------------------------------------------------------------
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
            self._store(run, run_id, handle, emb, list(dict.fromkeys(tokens)))

    def _store(self, run: Run, run_id: str, handle: str, emb: np.ndarray, toks: list[str]) -> None:
        """Write one entry if its upper-bound cost fits the run's budget; count what it really costs."""
        slot = run.slot_of.get(handle)
        known = [run.token_id.get(t) for t in toks]
        if slot is not None:
            old = run.token_ids[slot]
            if None not in known and np.array_equal(np.sort(np.asarray(known, np.int32)), old):
                if np.array_equal(run.embeddings[slot], emb):
                    return  # the same submission again (a retry after a lost reply): already stored
                if run.updates:  # trainable expansion: the same items, a new embedding
                    run.embeddings[slot][:] = emb
                    return
            if not run.updates:
                raise RequestError("this handle has already submitted to this run", 409)
        elif len(run.handles) >= self.limits.max_entries:
            raise RequestError(f"run is full ({self.limits.max_entries} handles)", 429)
        new = [t for t, i in zip(toks, known) if i is None]
        old_ids = set(run.token_ids[slot].tolist()) if slot is not None else set()
        added = [i for i in known if i is not None and i not in old_ids]
        n_handles = len(run.handles) + (slot is None)
        n_tokens = len(run.token_id) + len(new)
        cost = ndarray_bytes(len(toks)) - (obj_bytes(run.token_ids[slot]) if slot is not None else 0)
        if slot is None:
            cost += TOKEN_STR_BYTES + INT_BYTES + ndarray_bytes(run.dim)
            cost += max(0, dict_bytes(n_handles) - obj_bytes(run.slot_of))
            cost += sum(max(0, list_bytes(n_handles) - obj_bytes(c)) for c in (run.handles, run.embeddings, run.token_ids))
        if new:
            cost += len(new) * (TOKEN_STR_BYTES + INT_BYTES + array_bytes(1))
            cost += max(0, dict_bytes(n_tokens) - obj_bytes(run.token_id)) + max(0, list_bytes(n_tokens) - obj_bytes(run.postings))
        size, postings = sys.getsizeof, run.postings
        for i in added:  # a posting array that is full grows by 1/16 (CPython's array_resize), at most +8 slots
            buffer, n = size(postings[i]) - ARRAY_FIXED, len(postings[i]) + 1
            if 4 * n > buffer:
                cost += 4 * (n + (n >> 4) + 8) - buffer
        if run.stored_bytes + cost > run.budget:
            raise RequestError(f"run '{run_id}' storage budget exhausted: {run.stored_bytes} of its {run.budget} "
                               f"bytes used, this submit needs up to {cost} more", 429)
        # apply, counting the real sizes
        before = sum(obj_bytes(c) for c in run.containers()) + sum(size(postings[i]) for i in added)
        delta = 0
        if slot is None:
            slot = len(run.handles)
            run.slot_of[handle] = slot
            run.handles.append(handle)
            run.embeddings.append(emb)
            run.token_ids.append(np.zeros(0, np.int32))
            delta += obj_bytes(handle) + INT_BYTES + obj_bytes(emb)
        else:
            run.embeddings[slot][:] = emb
            for i in old_ids.difference(i for i in known if i is not None):  # an update replaces the old entry
                was = size(postings[i])
                postings[i].remove(slot)
                delta += size(postings[i]) - was
            delta -= obj_bytes(run.token_ids[slot])
        for t in new:
            run.token_id[t] = len(postings)
            added.append(len(postings))
            postings.append(array.array("i"))
            delta += TOKEN_STR_BYTES + INT_BYTES + ARRAY_OVERHEAD  # + its array, below
        for i in added:
            postings[i].append(slot)
        ids = np.fromiter((run.token_id[t] for t in toks), np.int32, len(toks))
        ids.sort()
        run.token_ids[slot] = ids
        delta += obj_bytes(ids) + sum(size(postings[i]) for i in added)
        delta += sum(obj_bytes(c) for c in run.containers()) - before
        run.stored_bytes += delta

    # -- fetch --------------------------------------------------------------------------
    def neighbours(self, run_id: str, handle: str, secret: str | None = None) -> np.ndarray:
        """Embeddings [<= N, dim] of other clients sharing >= 1 token, most shared tokens first."""
        with self.lock:
            run = self._run(run_id, secret)
            slot = run.slot_of.get(handle) if isinstance(handle, str) else None
            if slot is None:
                raise RequestError("this handle has not submitted to this run", 404)
            chosen = self._match(run, slot) if run.match == "shared_items" else self._random(run, slot)
            if not chosen:
                return np.zeros((0, run.dim), np.float32)
            return np.stack([run.embeddings[s] for s in chosen])

    @staticmethod
    def _random(run: Run, slot: int) -> list[int]:
        """At most N other slots drawn uniformly without replacement, whatever they rated (match = random)."""
        others = len(run.handles) - 1
        picks = _SYSTEM_RANDOM.sample(range(others), min(run.max_neighbours, others))
        return [p + (p >= slot) for p in picks]  # skip the asking slot itself

    @staticmethod
    def _match(run: Run, slot: int) -> list[int]:
        """Slots sharing a token with `slot`: most shared tokens first, then by handle; at most N."""
        n = len(run.handles)
        counts = np.zeros(n, np.int64)
        views: list[np.ndarray] = []
        try:  # views export the arrays' buffers: drop them before anyone appends again
            size = 0
            for i in run.token_ids[slot].tolist():
                if len(run.postings[i]):
                    views.append(np.frombuffer(run.postings[i], np.int32))
                    size += len(views[-1])
                if size >= MATCH_CHUNK:
                    counts += np.bincount(np.concatenate(views), minlength=n)
                    views.clear()
                    size = 0
            if views:
                counts += np.bincount(np.concatenate(views), minlength=n)
        finally:
            views.clear()
        counts[slot] = 0
        cand = np.flatnonzero(counts)
        cap = run.max_neighbours
        if cand.size > cap:
            c = counts[cand]
            kth = np.partition(c, c.size - cap)[c.size - cap]  # the N-th largest count
            above = cand[c > kth].tolist()
            tied = heapq.nsmallest(cap - len(above), cand[c == kth].tolist(), key=run.handles.__getitem__)
            cand = above + tied
        else:
            cand = cand.tolist()
        return sorted(cand, key=lambda s: (-int(counts[s]), run.handles[s]))

    # -- accounting ---------------------------------------------------------------------
    def stats(self, admin_token: str | None = None) -> dict:
        """The memory accounting and per-run usage (the operator's GET /stats); no secrets, no handles."""
        _check_token(admin_token, self.admin_token, "admin token")
        with self.lock:
            runs = {rid: {"budget_bytes": r.budget, "stored_bytes": r.stored_bytes, "entries": len(r.handles),
                          "tokens": len(r.token_id)} for rid, r in self.runs.items()}
        return {**self.budget.snapshot(), "stored_bytes": sum(r["stored_bytes"] for r in runs.values()),
                "process_rss_bytes": process_rss_bytes(), "runs": runs}


# -- HTTP ---------------------------------------------------------------------------------
def _json(status: int, body: dict) -> web.Response:
    resp = web.json_response(body, status=status)
    if status >= 400:
        resp.force_close()  # after a refusal nothing more is read from this connection
    return resp


def _raw_reply(status: int, reason: str) -> bytes:
    """A whole HTTP reply written before any request was read (a connection refused at the door)."""
    body = json.dumps({"error": reason}).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % (status, HTTPStatus(status).phrase.encode(), len(body))) + body


def _address_key(peername) -> str:
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
def _is_loopback(key: str) -> bool:
    try:
        return ipaddress.ip_address(key).is_loopback
    except ValueError:
        return False


class _RefusalLog:
    """One INFO line per refusal, at most `per_second` of them; the rest are counted and summed up in one line."""

    def __init__(self, per_second: int = 20):
        self.per_second, self.window, self.count, self.suppressed = per_second, 0.0, 0, 0

    def note(self, peer: str, what: str, status: int, reason: str) -> None:
        """Log (or count) one refusal; called on the event-loop thread only."""
        now = time.monotonic()
        if now - self.window >= 1.0:
            if self.suppressed:
                log.info("refused %d more requests in the last %.0fs (not logged one by one)", self.suppressed,
                         now - self.window)
            self.window, self.count, self.suppressed = now, 0, 0
        if self.count < self.per_second:
            self.count += 1
            log.info("refused %s from %s: %d %s", what[:120], peer, status, reason[:200])
        else:
            self.suppressed += 1


class _Gate:
    """Connections and in-flight requests, counted in all and per client address (event-loop thread only).

    Hand-written: aiohttp's server has no connection or per-client limits of its own (its
    `keepalive_timeout` closes idle connections, which we use, but does not cap how many are held).

    An address at its connection limit (or the service at its total) does not lock others of that
    address out: a new connection displaces the address's longest-idle one (half-open, still sending
    its head, or kept alive between requests) once that has idled `evict_after_s`; only when none
    has is the new one refused. A connection whose request is being served is never displaced.
    With `exempt_loopback` the per-address limits skip loopback clients: they run on the service's
    own machine (a simulation's devices), where strangers and honest clients share one address and
    a per-address cap could not tell them apart; the totals still apply to them.
    """

    def __init__(self, limits: Limits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.evict_after_s = min(1.0, limits.idle_timeout_s / 2)
        self.connections: dict[str, int] = {}
        self.inflight: dict[str, int] = {}
        self.idle: dict[str, dict[object, float]] = {}  # address -> {connection: idle since}, oldest first
        self.member: dict[object, str] = {}  # connection -> its address
        self.total_connections = 0
        self.total_inflight = 0
        self.displaced = 0

    def admit(self, key: str, conn) -> str | None:
        """Count a new connection; the reason to refuse it instead, if over a limit with none to displace."""
        lim = self.limits
        if self.total_connections >= lim.max_connections and not self._displace(max(self.connections, key=self.connections.get)):
            return f"service busy ({lim.max_connections} connections held), retry later"
        if (self.connections.get(key, 0) >= lim.max_connections_per_address and not self._exempt(key)
                and not self._displace(key)):
            return f"too many connections from your address ({lim.max_connections_per_address}), retry later"
        self.total_connections += 1
        self.connections[key] = self.connections.get(key, 0) + 1
        self.member[conn] = key
        self.idle.setdefault(key, {})[conn] = self.clock()
        return None

    def _exempt(self, key: str) -> bool:
        return bool(self.limits.exempt_loopback) and _is_loopback(key)

    def _displace(self, key: str) -> bool:
        idle = self.idle.get(key)
        if not idle:
            return False
        conn, since = next(iter(idle.items()))  # the longest idle
        if self.clock() - since < self.evict_after_s:
            return False
        self.leave(conn)
        self.displaced += 1
        conn.force_close()
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


class _Protocol(web.RequestHandler):
    """aiohttp's connection handler, with per-address connection limits and JSON answers to parse errors."""

    peer_key: str | None = None
    _gate: _Gate | None = None

    def connection_made(self, transport) -> None:
        """Count the connection against its address (refused at once, with a 503, when over a limit)."""
        gate = self._manager.gate
        super().connection_made(transport)
        key = _address_key(transport.get_extra_info("peername"))
        reason = gate.admit(key, self)
        if reason is not None:
            self._manager.refusals.note(key, "connection", 503, reason)
            transport.write(_raw_reply(503, reason))
            self.force_close()
            return
        self._gate, self.peer_key = gate, key

    def connection_lost(self, exc) -> None:
        """Uncount the connection, then let aiohttp clean up."""
        if self._gate is not None:
            self._gate.leave(self)
            self._gate = None
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc=None, message=None):
        """aiohttp's hook for requests it could not parse (or a crash): the first line of its reason as JSON."""
        reason = (message or HTTPStatus(status).phrase).splitlines()[0].rstrip(":")
        if self._manager is not None:
            self._manager.refusals.note(self.peer_key or "?", "unparsable request", status, reason)
        return _json(status, {"error": reason})


class _Server(web.Server):
    def __init__(self, handler, *, gate: _Gate, refusals: _RefusalLog, **kwargs):
        super().__init__(handler, **kwargs)
        self.gate, self.refusals = gate, refusals

    def __call__(self):  # one _Protocol per connection
        return _Protocol(self, loop=self._loop, **self._kwargs)


def _bearer(request) -> str | None:
    value = request.headers.get("Authorization", "")
    return value[7:].strip() if value.startswith("Bearer ") else None


@dataclass(frozen=True)
class _Route:
    kind: str  # health, stats, open, close, submit, neighbours
    run_id: str | None = None

    @property
    def action(self) -> str:
        return "member" if self.kind in ("submit", "neighbours") else "admin"


def _route(method: str, path: str) -> _Route:
    """The endpoint a request head names; 404 / 405 for anything else."""
    parts = path.strip("/").split("/")
    if parts in (["health"], ["stats"]):
        if method != "GET":
            raise RequestError(f"{method[:20]} not allowed on /{parts[0]}", 405)
        return _Route(parts[0])
    known = parts == ["runs"] or (len(parts) == 3 and parts[0] == "runs" and parts[2] in ("submit", "neighbours", "close"))
    if not known:
        raise RequestError(f"no such endpoint {path[:100]}", 404)
    if method != "POST":
        raise RequestError(f"{method[:20]} not allowed on {path[:100]}; use POST", 405)
    return _Route("open") if parts == ["runs"] else _Route(parts[2], parts[1])


def _parse_body(raw: bytes) -> dict:
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


class _App:
    """Routes requests to a NeighbourService: credentials from the head, then limits, then the body."""

    def __init__(self, service: NeighbourService, gate: _Gate, refusals: _RefusalLog):
        self.service, self.limits, self.gate, self.refusals = service, service.limits, gate, refusals
        self.body_reads = 0  # bodies this app has started to read (tests check that refusals read none)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        self.gate.busy(request.protocol)
        try:
            return await self._handle(request)
        finally:
            self.gate.rest(request.protocol)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        peer = getattr(request.protocol, "peer_key", None) or "?"
        what = f"{request.method} {request.path}"
        try:
            route = _route(request.method, request.path)
            if route.kind == "health":
                return await self._send(request, _json(200, {"status": "ok"}), close=self._has_body(request))
            run = self.service.authorize(route.action, route.run_id, _bearer(request))
        except RequestError as exc:  # not authenticated: answered now, body unread, connection closed
            self.refusals.note(peer, what, exc.status, str(exc))
            return await self._send(request, _json(exc.status, {"error": str(exc)}), close=True)
        reason = self.gate.start_request(peer)
        if reason is not None:
            self.refusals.note(peer, what, 503, reason)
            return await self._send(request, _json(503, {"error": reason}))
        try:
            return await self._serve(request, route, run)
        except RequestError as exc:
            self.refusals.note(peer, what, exc.status, str(exc))
            return await self._send(request, _json(exc.status, {"error": str(exc)}))
        except Exception:  # a bug must still answer, not drop the connection
            log.exception("internal error on %s", what[:120])
            return await self._send(request, _json(500, {"error": "internal error"}))
        finally:
            self.gate.end_request(peer)

    @staticmethod
    def _has_body(request) -> bool:
        return bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()

    def _body_limit(self, route: _Route, run: Run | None) -> int:
        if route.kind == "submit" and run is not None:
            return run.submit_body_limit(self.limits.max_body_bytes)
        return min(self.limits.max_body_bytes, SMALL_BODY_BYTES)

    async def _serve(self, request, route: _Route, run: Run | None) -> web.StreamResponse:
        limit = self._body_limit(route, run)
        declared = request.content_length
        if declared is not None and declared > limit:
            raise RequestError(f"request body over {limit} bytes", 413)
        need = PARSE_FACTOR * (declared if declared is not None else limit) + PARSE_FIXED
        if route.kind == "neighbours" and run is not None:
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
            svc, token = self.service, _bearer(request)
            if route.kind == "neighbours":
                return await self._send_neighbours(request, route.run_id, body, token)
            if route.kind == "stats":
                return await self._send(request, _json(200, await asyncio.to_thread(svc.stats, token)))
            status, out = await asyncio.to_thread(self._call, route, body, token)
            return await self._send(request, _json(status, out))
        finally:
            budget.release_request(need)

    async def _read(self, request, limit: int) -> bytes:
        """The body, at most `limit` bytes, within io_timeout_s (aiohttp's client_max_size does the counting).

        The deadline is ours: the low-level aiohttp server has no per-request body timeout. So is the
        `100 Continue` (web.Application's expect handler is not there): sent only now, after the
        credential and the size were checked, which is what the client asked to wait for.
        """
        self.body_reads += 1
        if request.headers.get("Expect", "").lower() == "100-continue":  # curl asks before bodies over 1 KiB
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            async with asyncio.timeout(self.limits.io_timeout_s):
                return await request.clone(client_max_size=limit).read()
        except TimeoutError:
            raise RequestError(f"request body not received within {self.limits.io_timeout_s:g}s", 408) from None
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"request body over {limit} bytes", 413) from None

    def _call(self, route: _Route, raw: bytes, token) -> tuple[int, dict]:
        """Parse and run one open / close / submit (on a worker thread: large bodies do not block the loop)."""
        body, svc = _parse_body(raw), self.service
        if route.kind == "open":
            secret = svc.open_run(body.get("run_id"), body.get("dim"), body.get("max_tokens"), body.get("max_neighbours"),
                                  body.get("updates", False), token, body.get("memory_bytes"),
                                  body.get("match", "shared_items"))
            run = svc.runs.get(body.get("run_id"))
            return 200, {"status": "open", "secret": secret, "memory_bytes": run.budget if run else None}
        if route.kind == "close":
            svc.close_run(route.run_id, token)
            return 200, {"status": "closed"}
        svc.submit(route.run_id, body.get("handle"), body.get("embedding"), body.get("tokens"), token)
        return 200, {"status": "stored"}

    async def _send_neighbours(self, request, run_id: str, raw: bytes, token) -> web.StreamResponse:
        """The reply {"embeddings": [...], "dim": d}: whole when small, else streamed in chunks of rows."""
        emb = await asyncio.to_thread(lambda: self.service.neighbours(run_id, _parse_body(raw).get("handle"), token))
        n, dim = emb.shape
        if n * dim * SUBMIT_BYTES_PER_VALUE <= WHOLE_REPLY_BYTES:
            return await self._send(request, _json(200, {"embeddings": emb.tolist(), "dim": dim}))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json; charset=utf-8"})
        resp.enable_chunked_encoding()
        rows = max(1, (64 << 10) // (SUBMIT_BYTES_PER_VALUE * dim))

        async def write():
            await resp.prepare(request)
            await resp.write(b'{"embeddings": [')
            for start in range(0, n, rows):
                text = await asyncio.to_thread(_rows_json, emb[start:start + rows])
                await resp.write(((", " if start else "") + text).encode())
            await resp.write(b'], "dim": %d}' % dim)
            await resp.write_eof()

        return await self._send(request, resp, write=write)

    async def _send(self, request, resp: web.StreamResponse, close: bool = False, write=None) -> web.StreamResponse:
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
        if close:
            request.protocol.force_close()
        return resp


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """Server-side TLS from the deployment's certificate (deploy/make_certs.sh: server.pem / server.key)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


async def start(service: NeighbourService, host: str, port: int, ssl_context: ssl.SSLContext | None = None):
    """Listen on host:port (TLS when `ssl_context`); returns (async stop(), bound port) once accepting."""
    lim = service.limits
    service.budget.set_fixed("connections", lim.max_connections * CONNECTION_BYTES)
    service.budget.set_fixed("threads", THREAD_RESERVE_BYTES)
    gate, refusals = _Gate(lim), _RefusalLog()
    app = _App(service, gate, refusals)
    server = _Server(app, gate=gate, refusals=refusals, keepalive_timeout=lim.idle_timeout_s,
                     lingering_time=min(2.0, lim.io_timeout_s), max_headers=MAX_HEADERS, max_line_size=MAX_HEAD_LINE,
                     max_field_size=MAX_HEAD_LINE, auto_decompress=False, access_log=None)
    server.app = app
    runner = web.ServerRunner(server, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, backlog=512)
    await site.start()

    async def sweep():  # abandoned runs are freed even when no request comes
        while True:
            await asyncio.sleep(max(1.0, min(60.0, lim.run_ttl_s / 4)))
            await asyncio.to_thread(service.expire)

    sweeper = asyncio.get_running_loop().create_task(sweep())

    async def stop():
        sweeper.cancel()
        await runner.cleanup()

    stop.server = server
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
        self.app: _App = self._stop.server.app
        self.gate: _Gate = self.app.gate

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


def _raise_fd_limit(wanted: int) -> None:
    """Let the process hold `wanted` file descriptors if the hard limit allows (max_connections needs them)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and soft < wanted:
            log.warning("file-descriptor limit %d is below --max-connections + 64 = %d", soft, wanted)
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> None:
    """Console script: fedrec-neighbour-service --host 0.0.0.0 --port 8765 --admin-token-file F [--certfile --keyfile]"""
    ap = argparse.ArgumentParser(description="FedGNN third-party neighbour service")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--admin-token-file", help=f"file holding the operator token (else ${ADMIN_TOKEN_ENV})")
    ap.add_argument("--certfile", help="TLS certificate (PEM); with --keyfile the service speaks HTTPS only")
    ap.add_argument("--keyfile", help="TLS private key (PEM)")
    ap.add_argument("--parent-pid", type=int, default=0,
                    help="stop when this process is gone (a service started for one run, not left behind if it is killed)")
    for f in dataclasses.fields(Limits):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, metavar="N")
    args = ap.parse_args(argv)
    if bool(args.certfile) != bool(args.keyfile):
        ap.error("--certfile and --keyfile go together")
    try:
        token = _read_admin_token(args.admin_token_file)
        limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
        limits.check()
    except (OSError, ValueError) as exc:
        ap.error(str(exc))
    logging.basicConfig(level=logging.INFO)
    ctx = tls_context(args.certfile, args.keyfile) if args.certfile else None
    _raise_fd_limit(limits.max_connections + 64)

    async def run_forever():
        service = NeighbourService(limits, token)
        stop, port = await start(service, args.host, args.port, ctx)
        service.budget.set_fixed("process", process_rss_bytes() or 0)  # the interpreter, numpy, aiohttp: measured
        pool = service.budget.data_pool
        if pool < RUN_FIXED_BYTES * limits.max_runs:
            await stop()
            raise SystemExit(f"fedrec-neighbour-service: --max-memory-bytes {limits.max_memory_bytes} leaves no room "
                             f"for data: {json.dumps(service.budget.snapshot()['fixed'])} and a request pool of "
                             f"{service.budget.request_capacity} bytes take it all")
        log.info("neighbour service listening on %s://%s:%d (data pool %d bytes, %d per run by default)",
                 "https" if ctx else "http", args.host, port, pool, service.default_run_budget())
        if not args.parent_pid:
            await asyncio.Event().wait()
        while os.getppid() == args.parent_pid:  # re-parented once the parent dies, however it died
            await asyncio.sleep(1.0)
        log.info("parent process %d is gone: stopping", args.parent_pid)
        await stop()

    try:
        asyncio.run(run_forever())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
