"""Console logging of the app's entry points: the `fedrec_flwr` logger's INFO lines on stderr, and a
filter that keeps Flower's own per-round lines and end-of-run History dump off the console."""

from __future__ import annotations

import logging
import sys


def configure_console_logging(level: int = logging.INFO) -> logging.Logger:
    """Give the `fedrec_flwr` logger one stderr handler (once per process), so library log lines show
    up in `flwr run` output as `[fedrec_flwr.<module>] message`; library modules only call getLogger."""
    root = logging.getLogger("fedrec_flwr")
    if not any(getattr(h, "_fedrec_console", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
        handler._fedrec_console = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)
    return root


# Flower 1.42 has no setting for these lines: flwr/server/server.py logs them unconditionally at INFO on
# the "flwr" logger (Server.fit: "[ROUND %s]" and blank lines; fit_round / evaluate_round: the
# configure_* / aggregate_* lines; run_fl: "[SUMMARY]" and the History dump, one "\t%s" record per
# line of str(History)); ServerConfig has num_rounds and round_timeout only, and FLWR_LOG_LEVEL
# (flwr/supercore/logger.py) is read once at import and would drop every INFO line. So the ServerApp
# filters them by their message templates: every other Flower line, and every warning, still shows.
FLOWER_ROUND_MESSAGES = frozenset({
    "",
    "[ROUND %s]",
    "configure_fit: strategy sampled %s clients (out of %s)",
    "configure_fit: no clients selected, cancel",
    "aggregate_fit: received %s results and %s failures",
    "configure_evaluate: strategy sampled %s clients (out of %s)",
    "configure_evaluate: no clients selected, skipping evaluation",
    "aggregate_evaluate: received %s results and %s failures",
    "fit progress: (%s, %s, %s, %s)",
    "[SUMMARY]",
    "\t%s",
})


class FlowerRoundFilter(logging.Filter):
    """Drops Flower's INFO lines of every round and its History dump (FLOWER_ROUND_MESSAGES)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not (isinstance(record.msg, str)
                                                     and record.msg in FLOWER_ROUND_MESSAGES)


_FLOWER_FILTER = FlowerRoundFilter()


def show_flower_round_logs(show: bool) -> None:
    """Keep (`show`) or drop Flower's per-round INFO lines and end-of-run History dump, by a filter on
    the "flwr" logger of this process (the ServerApp's); our own `[fedgnn]` / `[fppdm]` line per round stays."""
    flower = logging.getLogger("flwr")
    if show:
        flower.removeFilter(_FLOWER_FILTER)
    else:
        flower.addFilter(_FLOWER_FILTER)  # once: logging ignores a filter it already has
