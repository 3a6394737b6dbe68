"""The neighbour service's bounds (one per command-line flag) and the error it refuses a request with.

`Limits` caps what one client can make the service spend: memory, time, connections, runs. The
console script builds it from its flags (`cli.py`); `Limits.check` names the first value out of
range, so a bad flag is reported as a usage error, not found later as a crash. `RequestError`
carries a refusal's reason and HTTP status from wherever it is raised to the HTTP layer, which
answers it as `{"error": reason}`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# floats are seconds and must be positive; these integers may also be 0 (their field comment says what 0 means)
ZERO_ALLOWED = ("max_inflight", "max_run_memory_bytes", "max_request_memory_bytes")


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
    max_inflight: int = 128  # authenticated requests served at once; more are answered 503 (0: refuse all)
    max_connections: int = 512  # connections held at once, over all clients
    max_connections_per_address: int = 64  # connections one client address (IPv6: one /64) may hold
    max_inflight_per_address: int = 32  # authenticated requests one address may have served at once
    exempt_loopback: int = 1  # 1: per-address limits skip 127.0.0.0/8 and ::1 (the service's own machine); 0: apply
    max_run_memory_bytes: int = 0  # a run's storage budget when it asks for none; 0: data pool / max_runs
    max_request_memory_bytes: int = 0  # working memory of the requests being served; 0: max_memory_bytes / 8

    def check(self) -> None:
        """Raise ValueError naming the first value out of range as its flag (the CLI reports it as a usage error)."""
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
            low = 0 if f.name in ZERO_ALLOWED else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name} must be an integer >= {low}, got {value!r}")
