"""Client side of the neighbour service: open / close runs (admin), submit and fetch (run members).

The service is a third party: the device checks every reply before using it. A reply must be a
JSON object within a size bound; neighbours must be a [n, dim] table of finite float32 numbers with
dim the run's embedding size and n at most the run's max_neighbours. Anything else raises
NeighbourServiceError naming what was wrong, and nothing of the reply is used.
"""

from __future__ import annotations

import json
import math
import ssl
import time
import urllib.error
import urllib.request

import numpy as np

HARD_MAX_NEIGHBOURS = 1000  # the service's own cap (Limits.max_neighbours): used when the run's N is not known
HARD_MAX_DIM = 1024  # likewise Limits.max_dim
MAX_SMALL_REPLY_BYTES = 64 << 10  # every reply but neighbours is a few short fields
FLOAT32_MAX = float(np.finfo(np.float32).max)  # a larger value is inf on the device
REPLY_BYTES_PER_VALUE = 32  # a float32 printed as a JSON float64 is at most 24 characters, plus ', '


class NeighbourServiceError(RuntimeError):
    """The service refused a request, sent a reply that fails the checks, or could not be reached within the retries."""


class NeighbourClient:
    """Talks JSON over HTTP(S) to one neighbour service, retrying connection failures and 503 `retries` times.

    `token` is sent as `Authorization: Bearer`: the admin token for open_run / close_run, the run's
    secret for submit / neighbours. With `ca_file` the service must present a certificate signed by
    that CA (HTTPS); an address without a scheme then means https://. `dim` and `max_neighbours`:
    the run's embedding size and neighbour cap, which every neighbours reply is checked against
    (also learnt from open_run and submit on this client, or given to neighbours()).
    """

    def __init__(self, address: str, retries: int = 3, backoff_s: float = 0.5, timeout_s: float = 10.0,
                 token: str | None = None, ca_file: str | None = None, *, dim: int | None = None,
                 max_neighbours: int | None = None):
        scheme = "https" if ca_file else "http"
        self.base = address if address.startswith(("http://", "https://")) else f"{scheme}://{address}"
        self.retries, self.backoff_s, self.timeout_s, self.token = retries, backoff_s, timeout_s, token
        self.context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.dim, self.max_neighbours = dim, max_neighbours
        self._runs: dict[str, dict[str, int]] = {}  # run id -> what this client learnt of it (dim, max_neighbours)

    def _bad(self, path: str, what: str) -> NeighbourServiceError:
        return NeighbourServiceError(f"neighbour service at {self.base} sent an invalid reply to {path}: {what}")

    def _post(self, path: str, body: dict | None, max_reply_bytes: int = MAX_SMALL_REPLY_BYTES) -> dict:
        """POST `body` as JSON (GET when None); the reply's JSON object, after the retries and checks."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(f"{self.base}{path}", data=data, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.context) as resp:  # noqa: S310
                    raw = resp.read(max_reply_bytes + 1)
                break
            except urllib.error.HTTPError as exc:  # the service answered: a refusal is final, "busy" is not
                try:
                    reason = json.loads(exc.read(MAX_SMALL_REPLY_BYTES)).get("error", exc.reason)
                except (ValueError, AttributeError, OSError):
                    reason = exc.reason
                reason = str(reason).splitlines()[0][:300] if str(reason) else str(exc.code)
                if exc.code != 503 or attempt == self.retries:
                    raise NeighbourServiceError(f"neighbour service at {self.base} refused {path}: {reason}") from None
                last = exc
            except (urllib.error.URLError, OSError) as exc:
                if isinstance(getattr(exc, "reason", exc), ssl.SSLCertVerificationError):  # retrying cannot help
                    raise NeighbourServiceError(f"neighbour service at {self.base} failed TLS verification: "
                                                f"{getattr(exc, 'reason', exc)}") from None
                last = exc
            if attempt < self.retries:
                time.sleep(self.backoff_s * (2**attempt))
        else:
            raise NeighbourServiceError(
                f"neighbour service at {self.base} unreachable after {self.retries + 1} attempts: {last}"
            )
        if len(raw) > max_reply_bytes:
            raise self._bad(path, f"more than {max_reply_bytes} bytes")
        try:
            out = json.loads(raw)
        except (ValueError, RecursionError):
            raise self._bad(path, "not JSON") from None
        if not isinstance(out, dict):
            raise self._bad(path, f"a JSON {type(out).__name__}, not an object")
        return out

    def open_run(self, run_id: str, dim: int, max_tokens: int, max_neighbours: int, updates: bool = False,
                 memory_bytes: int | None = None, match: str = "shared_items") -> str:
        """Ask the service to accept submissions for a run (the recommendation server does this, with the
        admin token); returns the run's secret for its clients. `updates`: handles may re-submit.
        `memory_bytes`: the run's own storage budget (default: the service's per-run share). `match`: who a
        handle's neighbours are (shared_items, or random as a control)."""
        body = {"run_id": run_id, "dim": dim, "max_tokens": max_tokens, "max_neighbours": max_neighbours,
                "updates": updates, "match": match}
        if memory_bytes is not None:
            body["memory_bytes"] = memory_bytes
        out = self._post("/runs", body)
        secret = out.get("secret", "")
        if not isinstance(secret, str) or len(secret) > 256 or not secret.isascii() or not secret.isprintable():
            raise self._bad("/runs", "the run secret is not a short printable ASCII string")
        self._runs[run_id] = {"dim": dim, "max_neighbours": max_neighbours}
        return secret

    def stats(self) -> dict:
        """The service's memory accounting and per-run usage (GET /stats, with the admin token)."""
        return self._post("/stats", None)

    def close_run(self, run_id: str) -> None:
        """Make the service forget a run now (the recommendation server, when its run ends)."""
        self._post(f"/runs/{run_id}/close", {})

    def submit(self, run_id: str, handle: str, embedding: np.ndarray, tokens: list[str]) -> None:
        """Send this user's embedding and item tokens under its anonymous handle."""
        emb = np.asarray(embedding, float)
        if emb.ndim != 1 or not np.isfinite(emb).all():
            raise NeighbourServiceError(f"refusing to submit to {self.base}: the embedding must be a finite vector, "
                                        f"got shape {emb.shape}")
        self._post(f"/runs/{run_id}/submit", {"handle": handle, "embedding": emb.tolist(), "tokens": list(tokens)})
        self._runs.setdefault(run_id, {}).setdefault("dim", emb.size)

    def neighbours(self, run_id: str, handle: str, *, dim: int | None = None,
                   max_neighbours: int | None = None) -> np.ndarray:
        """The anonymous neighbours' embeddings for this handle, [<= N, dim] (also [0, dim] when it has none).

        The reply is checked: dim must equal the run's (`dim`, else the client's, else what this client
        submitted or opened the run with), every value finite as float32, and at most N rows
        (`max_neighbours`, else the client's, else open_run's, else the service's hard cap 1000).
        """
        known = self._runs.get(run_id, {})
        want_dim = dim or self.dim or known.get("dim")
        cap = max_neighbours or self.max_neighbours or known.get("max_neighbours") or HARD_MAX_NEIGHBOURS
        path = f"/runs/{run_id}/neighbours"
        size = REPLY_BYTES_PER_VALUE * cap * (want_dim or HARD_MAX_DIM) + MAX_SMALL_REPLY_BYTES
        out = self._post(path, {"handle": handle}, max_reply_bytes=size)
        return _check_neighbours(out, want_dim, cap, lambda what: self._bad(path, what))


def _check_neighbours(out: dict, want_dim: int | None, cap: int, bad) -> np.ndarray:
    """The [n, dim] float32 table of a neighbours reply, or `bad(reason)` raised for the first check it fails."""
    rows, got_dim = out.get("embeddings"), out.get("dim")
    if not isinstance(got_dim, int) or isinstance(got_dim, bool) or not 0 < got_dim <= HARD_MAX_DIM:
        raise bad(f"'dim' must be an integer in [1, {HARD_MAX_DIM}], got {str(got_dim)[:40]}")
    if want_dim is not None and got_dim != want_dim:
        raise bad(f"dimension {got_dim}, but this run's embeddings have {want_dim}")
    if not isinstance(rows, list):
        raise bad("'embeddings' must be a list of rows")
    if len(rows) > cap:
        raise bad(f"{len(rows)} neighbours, more than max_neighbours {cap}")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != got_dim:
            raise bad(f"row {i} is not a list of {got_dim} numbers")
        for x in row:
            if type(x) not in (int, float) or abs(x) > FLOAT32_MAX or not math.isfinite(x):
                raise bad(f"row {i} holds {str(x)[:40]!r}, not a finite float32 number")
    return np.asarray(rows, np.float32).reshape(len(rows), got_dim)
