"""The secret every privacy draw of a device comes from, and the cryptographically secure streams keyed by it.

A device's noise, coins, pseudo items and handles protect it only if the server cannot compute them. They must
therefore not come from anything the server holds (the run seed, round numbers, anything in a message), and the
generator must be one whose outputs do not give its state away: pseudo-item ids and upload noise are outputs, and a
seeded PCG64 or Mersenne Twister can be recovered from them.

- The secret: 32 bytes from the operating system (`secrets.token_bytes`), drawn by the device at its first start
  and kept in its own state (`load_or_create`); never sent anywhere and never printed (its repr is hidden).
- A stream: `generator(user, *stream)` is a numpy Generator over randomgen's ChaCha20 (RFC 8439's cipher, 20
  rounds, a 256-bit key), keyed by HMAC-SHA256(secret, user and stream numbers). Each (user, stream) therefore
  has its own independent key, and without the secret no stream can be told from random.

Why ChaCha20 (randomgen) rather than AES-CTR or `os.urandom`: it is a numpy BitGenerator, so every draw the code
makes (exponentials, normals, choices, bytes) is numpy's own sampler over a secure bit stream; its 256-bit key and
software-only design run in constant time on any CPU (AES-CTR is fast only with AES-NI). Its cost per user
against numpy's seeded PCG64 is measured by `benchmarks/roofline.py` (docs/benchmarks/performance.md, "FedGNN
per-user cost against its arithmetic floor": the `noise` and `noise_seeded_pcg64` columns). Reading the same bytes from
`os.urandom` would lose reproducibility: a simulation that fixes its devices' secrets
(`simulation.device_secrets`) replays bit for bit.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from pathlib import Path

import numpy as np
from randomgen import ChaCha

SECRET_BYTES = 32
_STREAM_LABEL = b"fedrec-flwr/device-stream/v1"
_FINGERPRINT_LABEL = b"fedrec-flwr/device-fingerprint/v1"


class DeviceSecretError(ValueError):
    """A device-secret file that cannot be used (wrong size, unreadable, or readable by others)."""


class DeviceSecret:
    """A device's 32-byte secret. `generator(user, *stream)` gives a secure, reproducible stream per user and
    purpose."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes):
        if not isinstance(key, (bytes, bytearray)) or len(key) != SECRET_BYTES:
            raise DeviceSecretError(f"a device secret is {SECRET_BYTES} bytes")
        self._key = bytes(key)

    @classmethod
    def fresh(cls) -> "DeviceSecret":
        """A new secret from the operating system's CSPRNG (`secrets`): what a device uses unless told otherwise."""
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def load_or_create(cls, path: Path | str) -> "DeviceSecret":
        """The secret in `path` (64 hex characters), created from the OS with mode 0600 if the file does not exist.

        Created with O_EXCL, so two processes starting at once end with the same secret; a file of another size
        or one that other users may read is refused (DeviceSecretError naming it)."""
        path = Path(path)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass  # another process created it first: read theirs
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_bytes(SECRET_BYTES).hex() + "\n")
        try:
            if path.stat().st_mode & 0o077:
                raise DeviceSecretError(f"device secret {path} can be read by other users (chmod 600 {path})")
            text = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise DeviceSecretError(f"device secret {path}: {exc}") from None
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != SECRET_BYTES:
            raise DeviceSecretError(f"device secret {path} does not hold {SECRET_BYTES * 2} hex characters")
        return cls(key)

    def generator(self, user: int, *stream: int) -> np.random.Generator:
        """The secure stream of `user` for purpose `stream` (e.g. its round's noise): ChaCha20 keyed by
        HMAC-SHA256(secret, user, *stream). The same secret and numbers give the same draws; nothing else does."""
        numbers = (int(user), *(int(s) for s in stream))
        key = hmac.new(self._key, _STREAM_LABEL + struct.pack(f"<{len(numbers)}q", *numbers), hashlib.sha256).digest()
        return np.random.Generator(ChaCha(key=int.from_bytes(key, "little"), counter=0, rounds=20))

    def hex_for_node_state(self) -> str:
        """The secret as hex, for the node's own state only (Context.state, never sent): how a simulated device keeps
        the secret it drew between messages."""
        return self._key.hex()

    @classmethod
    def from_node_state(cls, text: str) -> "DeviceSecret":
        """The secret `hex_for_node_state` kept."""
        return cls(bytes.fromhex(text))

    def fingerprint(self) -> str:
        """16 hex characters that tell two secrets apart (a one-way hash: they reveal nothing of the secret), so a
        study can check that two runs used the same fixed secrets."""
        return hmac.new(self._key, _FINGERPRINT_LABEL, hashlib.sha256).hexdigest()[:16]

    def __repr__(self) -> str:
        return "DeviceSecret(<hidden>)"

    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.fingerprint())


def simulation_secret(path: str) -> DeviceSecret:
    """The simulated devices' secret of an in-process run: the experimenter's file (`simulation.device_secrets`,
    created if missing) for a run that replays bit for bit, else a fresh one from the OS."""
    return DeviceSecret.load_or_create(path) if path else DeviceSecret.fresh()

