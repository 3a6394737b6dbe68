"""A copy of the Flower app's own files for `flwr run`, so that building its FAB does not walk the virtualenv.

`flwr run DIR` lists every file under DIR (resolving each path) before it applies .gitignore, so
with the project's .venv inside the checkout it visits some 40,000 files and spends about 5 s
on 2 cores before the run starts. `staged_app` copies only the files `.gitignore` keeps,
skipping ignored folders without entering them, into a fresh temporary folder; Flower then
builds the same FAB (its own include and exclude rules still apply) from about 150 files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pathspec


def _ignored(root: Path) -> pathspec.PathSpec:
    gitignore = root / ".gitignore"
    lines = gitignore.read_text(encoding="utf-8").splitlines() if gitignore.is_file() else []
    return pathspec.PathSpec.from_lines("gitwildmatch", [*lines, ".git/"])


def app_files(root: Path) -> list[str]:
    """The project's files (relative POSIX paths) that .gitignore does not exclude; ignored folders are not entered."""
    spec = _ignored(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if not spec.match_file(f"{(rel / d).as_posix()}/")
                             and not (Path(dirpath) / d).is_symlink())
        for name in sorted(filenames):
            path = (rel / name).as_posix()
            if not spec.match_file(path) and not (Path(dirpath) / name).is_symlink():
                found.append(path)
    return found


@contextmanager
def staged_app(root: Path, parent: Path) -> Iterator[Path]:
    """A temporary folder under `parent` holding `app_files(root)`, removed afterwards (each run has its own)."""
    parent.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix="flwr-app-", dir=parent))
    try:
        for rel in app_files(root):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, target)
        yield dest
    finally:
        shutil.rmtree(dest, ignore_errors=True)
