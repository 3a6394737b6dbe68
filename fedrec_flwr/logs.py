"""Console logging of the app's entry points: the `fedrec_flwr` logger's INFO lines on stderr."""

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
