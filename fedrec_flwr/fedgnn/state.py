"""What a FedGNN device keeps of each of its users between rounds, and its byte layout (a node's Flower state, an
in-process run's checkpoint), apart from the model code that uses it, so that stores read and write it without
importing the model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class UserState:
    """What a device keeps between rounds: its private embedding, its fixed anonymity set,
    and the anonymous neighbour embeddings graph expansion gave it."""

    embedding: np.ndarray  # [d] float32, never sent to the recommendation server
    anonymity_ids: np.ndarray  # sorted int64: rated train items, test items, pseudo items
    neighbours: np.ndarray  # [n <= N, d] float32, from the neighbour service
    handle: str  # random anonymous name towards the neighbour service
    offset: float = 0.0  # model.user_offset: the user's private rating offset, never sent

    def copy(self) -> "UserState":
        """An independent copy."""
        return UserState(self.embedding.copy(), self.anonymity_ids.copy(), self.neighbours.copy(), self.handle,
                         self.offset)


_HEADER = 5  # int64 sizes: embedding, ids, neighbour rows, neighbour width, handle bytes


def encode_state(st: UserState) -> bytes:
    """A UserState as one byte string (sizes, then the raw arrays): what a node keeps in its Flower state.

    Raw bytes because the node's state is rewritten for every sampled user in every round, and
    numpy's self-describing format costs ~100 times more to read back (its header is parsed as Python)."""
    emb = np.ascontiguousarray(st.embedding, "<f4").reshape(-1)
    ids = np.ascontiguousarray(st.anonymity_ids, "<i8").reshape(-1)
    nb = np.ascontiguousarray(st.neighbours, "<f4")  # [n, d]
    if nb.ndim != 2:
        raise ValueError(f"user state neighbours must be [n, d], got shape {nb.shape}")
    handle = bytes.fromhex(st.handle)
    head = np.array([emb.size, ids.size, nb.shape[0], nb.shape[1], len(handle)], "<i8")
    return b"".join((head.tobytes(), emb.tobytes(), ids.tobytes(), nb.tobytes(), handle, np.float64(st.offset).tobytes()))


def decode_state(blob: bytes) -> UserState:
    """The UserState `encode_state` wrote; ValueError if the bytes do not have its layout."""
    if len(blob) < 8 * _HEADER:
        raise ValueError(f"stored user state is {len(blob)} bytes, shorter than its header")
    n_emb, n_ids, n_nb, width, n_handle = (int(x) for x in np.frombuffer(blob, "<i8", _HEADER))
    sizes = (4 * n_emb, 8 * n_ids, 4 * n_nb * width, n_handle, 8)
    if min(n_emb, n_ids, n_nb, width, n_handle) < 0 or (n_nb and not width) or len(blob) != 8 * _HEADER + sum(sizes):
        raise ValueError(f"stored user state of {len(blob)} bytes does not match its header {[n_emb, n_ids, n_nb, width, n_handle]}")
    at = 8 * _HEADER
    parts = []
    for size in sizes:
        parts.append(blob[at : at + size])
        at += size
    emb, ids, nb, handle, offset = parts
    return UserState(np.frombuffer(emb, "<f4").astype(np.float32), np.frombuffer(ids, "<i8").astype(np.int64),
                     np.frombuffer(nb, "<f4").astype(np.float32).reshape(n_nb, width), handle.hex(),
                     float(np.frombuffer(offset, "<f8")[0]))
