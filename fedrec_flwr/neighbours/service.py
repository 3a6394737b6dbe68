"""The third-party neighbour service: matches equal item tokens, returns anonymous neighbours.

It is a separate process with its own address (`fedrec-neighbour-service --host H --port P`).
It never holds the token key: it sees, per run, random client handles, their user embeddings
and their item tokens, and answers each client with the embeddings of up to N other clients
sharing at least one token, with no handles, ids or item information. Clients reach it
directly; the recommendation server never relays these messages.

What it learns (threat model: it does not collude with the recommendation server): user
embeddings, the number of items each client submitted, and how often each token occurs (the
popularity histogram of the catalogue, without knowing which item a token is).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from .tokens import TOKEN_PATTERN

log = logging.getLogger("fedrec_flwr.neighbours")
HANDLE_PATTERN = TOKEN_PATTERN


class RequestError(ValueError):
    """A request the service refuses; the message says what was wrong (HTTP 400 or 404)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Run:
    """One run's submissions and inverted index token -> handles."""

    dim: int
    max_tokens: int
    max_neighbours: int
    embeddings: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: dict[str, frozenset[str]] = field(default_factory=dict)
    index: dict[str, set[str]] = field(default_factory=dict)


class NeighbourService:
    """In-memory matching state of every open run (thread-safe)."""

    def __init__(self, max_runs: int = 64):
        self.max_runs = max_runs
        self.runs: dict[str, Run] = {}
        self.lock = threading.Lock()

    def open_run(self, run_id: str, dim: int, max_tokens: int, max_neighbours: int) -> None:
        """Start accepting submissions for `run_id` (idempotent for identical settings)."""
        if not isinstance(run_id, str) or not run_id or len(run_id) > 64:
            raise RequestError("run_id must be a non-empty string of at most 64 characters")
        for name, value in (("dim", dim), ("max_tokens", max_tokens), ("max_neighbours", max_neighbours)):
            if not isinstance(value, int) or value <= 0:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
        with self.lock:
            existing = self.runs.get(run_id)
            if existing is not None:
                if (existing.dim, existing.max_tokens, existing.max_neighbours) != (dim, max_tokens, max_neighbours):
                    raise RequestError(f"run '{run_id}' is already open with other settings")
                return
            if len(self.runs) >= self.max_runs:
                raise RequestError(f"too many open runs (limit {self.max_runs})")
            self.runs[run_id] = Run(dim, max_tokens, max_neighbours)

    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise RequestError(f"unknown run '{run_id}' (not opened, or the service restarted)", 404)
        return run

    def submit(self, run_id: str, handle: str, embedding: list, tokens: list) -> None:
        """Store (or replace) one client's embedding and item tokens."""
        if not isinstance(handle, str) or not HANDLE_PATTERN.match(handle):
            raise RequestError("handle must be 32 lowercase hex characters")
        with self.lock:
            run = self._run(run_id)
            if not isinstance(tokens, list) or not tokens:
                raise RequestError("tokens must be a non-empty list")
            if len(tokens) > run.max_tokens:
                raise RequestError(f"too many tokens: {len(tokens)} > limit {run.max_tokens}")
            bad = next((t for t in tokens if not isinstance(t, str) or not TOKEN_PATTERN.match(t)), None)
            if bad is not None:
                raise RequestError(f"malformed token {str(bad)[:40]!r}: expected 32 lowercase hex characters")
            try:
                emb = np.asarray(embedding, dtype=np.float32)
            except (TypeError, ValueError):
                raise RequestError("embedding must be a list of numbers") from None
            if emb.shape != (run.dim,) or not np.isfinite(emb).all():
                raise RequestError(f"embedding must be {run.dim} finite numbers")
            for t in run.tokens.get(handle, ()):  # a resubmission replaces the old entry
                run.index[t].discard(handle)
            run.embeddings[handle] = emb
            run.tokens[handle] = frozenset(tokens)
            for t in run.tokens[handle]:
                run.index.setdefault(t, set()).add(handle)

    def neighbours(self, run_id: str, handle: str) -> np.ndarray:
        """Embeddings [<= N, dim] of other clients sharing >= 1 token, most shared tokens first."""
        with self.lock:
            run = self._run(run_id)
            if handle not in run.tokens:
                raise RequestError("this handle has not submitted to this run", 404)
            shared: dict[str, int] = {}
            for t in run.tokens[handle]:
                for other in run.index.get(t, ()):
                    if other != handle:
                        shared[other] = shared.get(other, 0) + 1
            chosen = sorted(shared, key=lambda h: (-shared[h], h))[: run.max_neighbours]
            if not chosen:
                return np.zeros((0, run.dim), np.float32)
            return np.stack([run.embeddings[h] for h in chosen])

    def close_run(self, run_id: str) -> None:
        """Forget everything about a run."""
        with self.lock:
            self.runs.pop(run_id, None)


def _handler(service: NeighbourService, max_body: int):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # route to logging, not stderr
            log.debug("%s " + fmt, self.address_string(), *args)

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server API)
            if self.path == "/health":
                return self._reply(200, {"status": "ok"})
            return self._reply(404, {"error": f"no such endpoint {self.path}"})

        def do_POST(self):  # noqa: N802
            length = int(self.headers.get("Content-Length", "0"))
            if length > max_body:
                return self._reply(413, {"error": f"request body over {max_body} bytes"})
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("request body must be a JSON object")
                parts = self.path.strip("/").split("/")
                if parts == ["runs"]:
                    service.open_run(body.get("run_id"), body.get("dim"), body.get("max_tokens"), body.get("max_neighbours"))
                    return self._reply(200, {"status": "open"})
                if len(parts) == 3 and parts[0] == "runs" and parts[2] == "submit":
                    service.submit(parts[1], body.get("handle"), body.get("embedding"), body.get("tokens"))
                    return self._reply(200, {"status": "stored"})
                if len(parts) == 3 and parts[0] == "runs" and parts[2] == "neighbours":
                    emb = service.neighbours(parts[1], body.get("handle"))
                    return self._reply(200, {"embeddings": emb.tolist()})
                return self._reply(404, {"error": f"no such endpoint {self.path}"})
            except json.JSONDecodeError:
                return self._reply(400, {"error": "request body is not valid JSON"})
            except RequestError as exc:
                return self._reply(exc.status, {"error": str(exc)})

    return Handler


def serve(host: str = "127.0.0.1", port: int = 0, max_body: int = 64 << 20) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Start the service in a background thread; returns the server (its port in server_address)."""
    httpd = ThreadingHTTPServer((host, port), _handler(NeighbourService(), max_body))
    thread = threading.Thread(target=httpd.serve_forever, name="neighbour-service", daemon=True)
    thread.start()
    return httpd, thread


def main() -> None:
    """Console script: fedrec-neighbour-service --host 0.0.0.0 --port 8765"""
    ap = argparse.ArgumentParser(description="FedGNN third-party neighbour service")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    httpd = ThreadingHTTPServer((args.host, args.port), _handler(NeighbourService(), 64 << 20))
    log.info("neighbour service listening on %s:%d", *httpd.server_address[:2])
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
