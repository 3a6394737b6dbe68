"""What the measurement scripts share: the datasets folder argument, one `fedrec run` call, a Markdown table.

`--data-dir` defaults to `data` (relative to the folder a script runs from), the same default as
`fedrec run`: put the datasets there, laid out as docs/datasets.md says, or pass the folder.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from fedrec_flwr.sweep import fedrec_run as fedrec_run  # one `fedrec run` call in this process (re-exported)

DATA_DIR = "data"


def add_data_dir(ap: argparse.ArgumentParser) -> None:
    """The `--data-dir` argument every script that reads a registry dataset takes."""
    ap.add_argument("--data-dir", default=DATA_DIR, help="folder holding the datasets (default: ./data)")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; floats to four decimals."""
    def cell(v: object) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
