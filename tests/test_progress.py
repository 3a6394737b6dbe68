"""Long data preparation reports progress; short work stays quiet."""

from __future__ import annotations

import io

from fedrec_flwr.progress import Progress


def test_progress_lines_only_for_slow_work():
    quiet = io.StringIO()
    p = Progress(100, "fast", every=60.0, stream=quiet)
    for _ in range(100):
        p.update()
    p.close()
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    p = Progress(4, "slow items", every=0.0, stream=loud)
    for _ in range(4):
        p.update()
    p.close()
    lines = loud.getvalue().splitlines()
    assert lines[0].startswith("slow items: 1/4 (25%)") and lines[-1].startswith("slow items: 4/4 (100%)")
