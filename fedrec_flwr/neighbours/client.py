"""Client side of the neighbour service: submit tokens and embedding, fetch neighbour embeddings."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np


class NeighbourServiceError(RuntimeError):
    """The service refused a request, or could not be reached within the configured retries."""


class NeighbourClient:
    """Talks JSON over HTTP to one neighbour service, retrying connection failures `retries` times."""

    def __init__(self, address: str, retries: int = 3, backoff_s: float = 0.5, timeout_s: float = 10.0):
        self.base = address if address.startswith("http") else f"http://{address}"
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s

    def _post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(f"{self.base}{path}", data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 (configured address)
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:  # the service answered: a refusal is final
                try:
                    reason = json.loads(exc.read()).get("error", exc.reason)
                except (ValueError, AttributeError):
                    reason = exc.reason
                raise NeighbourServiceError(f"neighbour service at {self.base} refused {path}: {reason}") from None
            except (urllib.error.URLError, OSError) as exc:
                last = exc
                if attempt < self.retries:
                    time.sleep(self.backoff_s * (2**attempt))
        raise NeighbourServiceError(
            f"neighbour service at {self.base} unreachable after {self.retries + 1} attempts: {last}"
        )

    def open_run(self, run_id: str, dim: int, max_tokens: int, max_neighbours: int) -> None:
        """Ask the service to accept submissions for a run (the recommendation server does this)."""
        self._post("/runs", {"run_id": run_id, "dim": dim, "max_tokens": max_tokens, "max_neighbours": max_neighbours})

    def submit(self, run_id: str, handle: str, embedding: np.ndarray, tokens: list[str]) -> None:
        """Send this user's embedding and item tokens under its anonymous handle."""
        self._post(f"/runs/{run_id}/submit", {"handle": handle, "embedding": np.asarray(embedding, float).tolist(), "tokens": tokens})

    def neighbours(self, run_id: str, handle: str) -> np.ndarray:
        """The anonymous neighbours' embeddings for this handle, [<= N, dim]."""
        out = self._post(f"/runs/{run_id}/neighbours", {"handle": handle})
        return np.asarray(out["embeddings"], np.float32).reshape(len(out["embeddings"]), -1)
