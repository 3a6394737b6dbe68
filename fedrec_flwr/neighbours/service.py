"""The neighbour service's state: every open run, with its credentials, validation, budgets and expiry.

`NeighbourService` is what the HTTP layer (`http_app.py`) calls, and what in-process tests call
directly. It never holds the token key: it sees, per run, random client handles, their user
embeddings and their item tokens, and answers each client with the embeddings of up to N other
clients chosen by `matching.py`, with no handles, ids or item information.

What it learns (threat model: it does not collude with the recommendation server): user
embeddings, the number of items each client submitted, and how often each token occurs (the
popularity histogram of the catalogue, without knowing which item a token is).

Credentials. Opening and closing a run, and the stats, need the operator's admin token; opening
returns a per-run secret that every submit and fetch must carry (compared in constant time). With
`admin_token=None` no credential is checked at all: that exists for in-process tests, and the
console script refuses to start so.

Memory (`memory.MemoryBudget`). Each run reserves its own storage budget from the data pool when
it opens: `memory_bytes` if the operator asks, else `max_run_memory_bytes`, else data pool /
`max_runs`. A run is refused (429) once its own budget is spent, whatever the other runs hold;
opening is refused (507) when the data pool cannot give the budget. An abandoned run is forgotten
after `run_ttl_s`, and its budget given back.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time

import numpy as np

from .limits import Limits, RequestError
from .matching import MATCHES, neighbour_slots, working_bytes
from .memory import MemoryBudget, process_rss_bytes
from .runs import RUN_FIXED_BYTES, Run
from .tokens import TOKEN_PATTERN

log = logging.getLogger("fedrec_flwr.neighbours")
HANDLE_PATTERN = TOKEN_PATTERN


def check_token(given, expected: str | None, what: str) -> None:
    """Refuse a missing credential (401) or a wrong one (403), compared in constant time; None expects nothing."""
    if expected is None:
        return
    if not isinstance(given, str) or not given:
        raise RequestError(f"missing {what} (Authorization: Bearer <token>)", 401)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise RequestError(f"wrong {what}", 403)


def valid_run_id(run_id) -> bool:
    """Whether `run_id` can name a run: a short ASCII string without '/' (it is part of the URL path)."""
    return isinstance(run_id, str) and 0 < len(run_id) <= 64 and run_id.isascii() and "/" not in run_id


def _unknown_run(run_id) -> RequestError:
    return RequestError(f"unknown run '{str(run_id)[:64]}' (not opened, closed, expired, or the service restarted)",
                        404)


class NeighbourService:
    """In-memory matching state of every open run (thread-safe), with its credentials and bounds."""

    def __init__(self, limits: Limits | None = None, admin_token: str | None = None, clock=time.monotonic):
        self.limits = limits or Limits()
        self.limits.check()
        self.admin_token = admin_token
        self.clock = clock
        self.runs: dict[str, Run] = {}
        self.lock = threading.Lock()
        lim = self.limits
        self.budget = MemoryBudget(lim.max_memory_bytes, lim.max_request_memory_bytes)
        # one matching computation at a time (under the lock): its arrays
        self.budget.set_fixed("matching", working_bytes(lim.max_entries, lim.max_tokens, lim.max_neighbours,
                                                        lim.max_dim))

    # -- runs ---------------------------------------------------------------------------
    def expire(self) -> list[str]:
        """Forget runs idle for longer than `run_ttl_s` and give their budgets back; returns their ids."""
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
        """The storage budget a run gets when it asks for none: max_run_memory_bytes, else data pool / max_runs."""
        return self.limits.max_run_memory_bytes or max(0, self.budget.data_pool) // self.limits.max_runs

    def open_run(self, run_id: str, dim: int, max_tokens: int, max_neighbours: int, updates: bool = False,
                 admin_token: str | None = None, memory_bytes: int | None = None, match: str = "shared_items") -> str:
        """Start accepting submissions for `run_id`; returns its secret (idempotent for identical settings).

        `memory_bytes`: the run's own storage budget, reserved now from the data pool (default:
        `default_run_budget()`); no other run can use it, and this run can use no more. `match`: one of
        MATCHES, who a handle's neighbours are.
        """
        check_token(admin_token, self.admin_token, "admin token")
        if not valid_run_id(run_id):
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
                same = (existing.dim, existing.max_tokens, existing.max_neighbours, existing.updates,
                        existing.match) == (dim, max_tokens, max_neighbours, updates, match)
                if not same or memory_bytes not in (None, existing.memory_requested):
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
            self.runs[run_id] = Run(dim, max_tokens, max_neighbours, updates, secret, self.clock(), budget,
                                    memory_bytes, match)
            return secret or ""

    def close_run(self, run_id: str, admin_token: str | None = None) -> None:
        """Forget everything about a run (the recommendation server calls this when its run ends)."""
        check_token(admin_token, self.admin_token, "admin token")
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
            check_token(token, self.admin_token, "admin token")
            return None
        run = self.runs.get(run_id) if valid_run_id(run_id) else None
        if run is None:
            raise _unknown_run(run_id)
        check_token(token, run.secret, "run secret")
        return run

    def _run(self, run_id: str, secret) -> Run:
        self._expire()
        run = self.runs.get(run_id) if isinstance(run_id, str) else None
        if run is None:
            raise _unknown_run(run_id)
        check_token(secret, run.secret, "run secret")
        run.touched = self.clock()
        return run

    # -- submit and fetch -----------------------------------------------------------------
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
            run.store(run_id, handle, emb, list(dict.fromkeys(tokens)), self.limits.max_entries)

    def neighbours(self, run_id: str, handle: str, secret: str | None = None) -> np.ndarray:
        """Embeddings [<= N, dim] of the handle's neighbours (matching.py), most shared tokens first."""
        with self.lock:
            run = self._run(run_id, secret)
            slot = run.slot_of.get(handle) if isinstance(handle, str) else None
            if slot is None:
                raise RequestError("this handle has not submitted to this run", 404)
            chosen = neighbour_slots(run, slot)
            if not chosen:
                return np.zeros((0, run.dim), np.float32)
            return np.stack([run.embeddings[s] for s in chosen])

    # -- accounting ---------------------------------------------------------------------
    def stats(self, admin_token: str | None = None) -> dict:
        """The memory accounting and per-run usage (the operator's GET /stats); no secrets, no handles."""
        check_token(admin_token, self.admin_token, "admin token")
        with self.lock:
            runs = {rid: {"budget_bytes": r.budget, "stored_bytes": r.stored_bytes, "entries": len(r.handles),
                          "tokens": len(r.token_id)} for rid, r in self.runs.items()}
        return {**self.budget.snapshot(), "stored_bytes": sum(r["stored_bytes"] for r in runs.values()),
                "process_rss_bytes": process_rss_bytes(), "runs": runs}
