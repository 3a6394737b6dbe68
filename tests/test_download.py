"""Downloader against a local HTTP fixture server: verified, atomic, clear when it fails."""

from __future__ import annotations

import hashlib
import http.server
import io
import threading
import zipfile
from functools import partial

import pytest

from fedrec_flwr.data import DataError
from fedrec_flwr.data.download import RemoteFile, download_file


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.RequestHandlerClass.log_message = lambda *a: None
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_download_verifies_and_caches(server, tmp_path):
    root, url = server
    payload = b"1\t1\t5\t0\n"
    (root / "u1.base").write_bytes(payload)
    spec = RemoteFile("ml-100k/u1.base", hashlib.sha256(payload).hexdigest(), f"{url}/u1.base")
    got = download_file(spec, tmp_path / "cache")
    assert got.read_bytes() == payload
    (root / "u1.base").unlink()  # second call is served from the cache
    assert download_file(spec, tmp_path / "cache") == got


def test_download_from_zip_member(server, tmp_path):
    root, url = server
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("ml-100k/u1.test", b"2\t3\t4\t0\n")
    (root / "ml.zip").write_bytes(buf.getvalue())
    spec = RemoteFile("ml-100k/u1.test", hashlib.sha256(b"2\t3\t4\t0\n").hexdigest(), f"{url}/ml.zip",
                      "ml-100k/u1.test")
    assert download_file(spec, tmp_path / "c").read_bytes() == b"2\t3\t4\t0\n"


def test_checksum_mismatch_leaves_nothing(server, tmp_path):
    root, url = server
    (root / "f.txt").write_bytes(b"tampered")
    spec = RemoteFile("d/f.txt", "0" * 64, f"{url}/f.txt")
    with pytest.raises(DataError, match="sha256 mismatch for d/f.txt"):
        download_file(spec, tmp_path / "cache")
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def test_unreachable_server_is_a_clear_error(tmp_path):
    spec = RemoteFile("d/f.txt", "0" * 64, "http://127.0.0.1:9/f.txt")
    with pytest.raises(DataError, match="download of http://127.0.0.1:9/f.txt failed"):
        download_file(spec, tmp_path, timeout=2)


def test_refuses_unverifiable_download(tmp_path):
    with pytest.raises(DataError, match="no sha256"):
        download_file(RemoteFile("x", None, "http://127.0.0.1:9/x"), tmp_path)
