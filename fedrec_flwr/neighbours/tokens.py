"""Keyed item tokens: equal items give equal tokens under one key, and nothing without the key.

Paillier ciphertexts are randomised (equal ids encrypt differently, so a service cannot
match them), and Paillier with fixed randomness is broken (the quotient of two ciphertexts
reveals the difference of the plaintexts). A keyed PRF is the sound tool: HMAC-SHA256 under
a key the recommendation server gives the clients and the neighbour service never gets.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

import numpy as np

TOKEN_HEX_CHARS = 32  # 128-bit tokens: collisions are negligible for any catalogue
TOKEN_PATTERN = re.compile(rf"^[0-9a-f]{{{TOKEN_HEX_CHARS}}}$")


def new_run_key() -> bytes:
    """A fresh 256-bit key for one run, drawn by the recommendation server."""
    return secrets.token_bytes(32)


def item_tokens(key: bytes, item_ids: np.ndarray) -> list[str]:
    """HMAC-SHA256(key, item id) per item, truncated to 128 bits, hex."""
    if len(key) < 16:
        raise ValueError("token key must have at least 128 bits")
    return [
        hmac.new(key, b"item:%d" % int(i), hashlib.sha256).hexdigest()[:TOKEN_HEX_CHARS]
        for i in np.asarray(item_ids).ravel()
    ]


def new_handle() -> str:
    """A random anonymous handle a client uses with the service instead of its user id."""
    return secrets.token_hex(16)
