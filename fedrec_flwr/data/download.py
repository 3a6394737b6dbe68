"""Fetch dataset files over HTTP(S) into a cache, verified by sha256, written atomically."""

from __future__ import annotations

import hashlib
import io
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fedrec_flwr.progress import Progress

from ..fsutil import atomic_write
from .types import DataError


@dataclass(frozen=True)
class RemoteFile:
    """A file a dataset needs: where it sits under the data dir, its sha256, and where to fetch it."""

    relpath: str
    sha256: str | None = None
    url: str | None = None
    member: str | None = None  # path inside a zip archive at `url`


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http/https only, checked below)
            total = int(resp.headers.get("Content-Length") or 0)
            progress = Progress(total or 1, f"downloading {url} (bytes)")
            chunks = []
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                chunks.append(chunk)
                progress.update(len(chunk))
            progress.close()
            return b"".join(chunks)
    except (urllib.error.URLError, OSError) as exc:
        raise DataError(f"download of {url} failed: {exc}") from exc


def download_file(spec: RemoteFile, cache_dir: Path, timeout: float = 60.0) -> Path:
    """Download `spec` into `cache_dir/relpath` unless a verified copy is already there.

    The bytes are checked against the sha256 before they reach the final path, so a
    failed or corrupted download never leaves a file that later runs would trust.
    """
    target = cache_dir / spec.relpath
    if target.is_file() and (spec.sha256 is None or sha256_of(target) == spec.sha256):
        return target
    if spec.url is None:
        raise DataError(f"no download address known for {spec.relpath}")
    if not spec.url.startswith(("http://", "https://")):
        raise DataError(f"refusing to download {spec.relpath} from non-HTTP address {spec.url}")
    if spec.sha256 is None:
        raise DataError(f"refusing to download {spec.relpath}: no sha256 is recorded to verify it")
    payload = _fetch(spec.url, timeout)
    if spec.member is not None:
        try:
            with zipfile.ZipFile(io.BytesIO(payload)) as archive:
                payload = archive.read(spec.member)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise DataError(f"{spec.url}: cannot read member '{spec.member}' from the zip archive: {exc}") from exc
    got = hashlib.sha256(payload).hexdigest()
    if got != spec.sha256:
        raise DataError(f"{spec.url}: sha256 mismatch for {spec.relpath}: expected {spec.sha256}, got {got}")
    atomic_write(target, payload)
    return target

