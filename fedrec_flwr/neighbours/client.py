"""Client side of the neighbour service: open / close runs (admin), submit and fetch (run members)."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request

import numpy as np


class NeighbourServiceError(RuntimeError):
    """The service refused a request, or could not be reached within the configured retries."""


class NeighbourClient:
    """Talks JSON over HTTP(S) to one neighbour service, retrying connection failures and 503 `retries` times.

    `token` is sent as `Authorization: Bearer`: the admin token for open_run / close_run, the run's
    secret for submit / neighbours. With `ca_file` the service must present a certificate signed by
    that CA (HTTPS); an address without a scheme then means https://.
    """

    def __init__(self, address: str, retries: int = 3, backoff_s: float = 0.5, timeout_s: float = 10.0,
                 token: str | None = None, ca_file: str | None = None):
        scheme = "https" if ca_file else "http"
        self.base = address if address.startswith(("http://", "https://")) else f"{scheme}://{address}"
        self.retries, self.backoff_s, self.timeout_s, self.token = retries, backoff_s, timeout_s, token
        self.context = ssl.create_default_context(cafile=ca_file) if ca_file else None

    def _post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(f"{self.base}{path}", data=data, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.context) as resp:  # noqa: S310
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:  # the service answered: a refusal is final, "busy" is not
                try:
                    reason = json.loads(exc.read()).get("error", exc.reason)
                except (ValueError, AttributeError):
                    reason = exc.reason
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
        raise NeighbourServiceError(
            f"neighbour service at {self.base} unreachable after {self.retries + 1} attempts: {last}"
        )

    def open_run(self, run_id: str, dim: int, max_tokens: int, max_neighbours: int, updates: bool = False) -> str:
        """Ask the service to accept submissions for a run (the recommendation server does this, with the
        admin token); returns the run's secret for its clients. `updates`: handles may re-submit."""
        out = self._post("/runs", {"run_id": run_id, "dim": dim, "max_tokens": max_tokens,
                                   "max_neighbours": max_neighbours, "updates": updates})
        return str(out.get("secret", ""))

    def close_run(self, run_id: str) -> None:
        """Make the service forget a run now (the recommendation server, when its run ends)."""
        self._post(f"/runs/{run_id}/close", {})

    def submit(self, run_id: str, handle: str, embedding: np.ndarray, tokens: list[str]) -> None:
        """Send this user's embedding and item tokens under its anonymous handle."""
        self._post(f"/runs/{run_id}/submit", {"handle": handle, "embedding": np.asarray(embedding, float).tolist(), "tokens": tokens})

    def neighbours(self, run_id: str, handle: str) -> np.ndarray:
        """The anonymous neighbours' embeddings for this handle, [<= N, dim] (also [0, dim] when it has none)."""
        out = self._post(f"/runs/{run_id}/neighbours", {"handle": handle})
        return np.asarray(out["embeddings"], np.float32).reshape(len(out["embeddings"]), int(out["dim"]))
