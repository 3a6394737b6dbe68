"""How the neighbour service logs what it refuses: one line per refusal, rate limited, never a traceback.

Strangers can make the service refuse as often as they like; each refusal is one INFO line, at
most `per_second` of them, the rest counted and summed up in one line. `ParseErrorLog` is the
logger given to aiohttp's connection handler (`handler_args={"logger": ...}`, a documented
setting): aiohttp answers a request head it cannot parse with its own 400 and logs the parser's
exception with a traceback; this adapter notes it as one refusal line instead and passes every
other record through unchanged.
"""

from __future__ import annotations

import logging
import time

from aiohttp.http import HttpProcessingError

from .gate import address_key

log = logging.getLogger("fedrec_flwr.neighbours")


class RefusalLog:
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


class ParseErrorLog(logging.LoggerAdapter):
    """aiohttp's handler logger: a request it could not parse becomes a refusal line, other records pass through."""

    def __init__(self, refusals: RefusalLog, logger: logging.Logger | None = None):
        super().__init__(logger or logging.getLogger("aiohttp.server"), {})
        self.refusals = refusals

    def log(self, level, msg, *args, exc_info=None, **kwargs) -> None:
        """Note an HTTP parse error (aiohttp logs it with the client's address as the first argument) as one line."""
        if isinstance(exc_info, HttpProcessingError):
            remote = args[0] if args and isinstance(args[0], str) else None
            reason = (exc_info.message or type(exc_info).__name__).strip().splitlines()[0].rstrip(":")
            self.refusals.note(address_key((remote, 0)) if remote else "?", "unparsable request", 400, reason)
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)
