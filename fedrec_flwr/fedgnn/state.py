"""What a FedGNN device keeps of each of its users between rounds, and its byte layout (a node's Flower state, an
in-process run's checkpoint), apart from the model code that uses it, so that stores read and write it without
importing the model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HANDLE_BYTES = 16  # a user's random name towards the neighbour service


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
    return b"".join((head.tobytes(), emb.tobytes(), ids.tobytes(), nb.tobytes(), handle,
                     np.float64(st.offset).tobytes()))


def decode_state(blob: bytes) -> UserState:
    """The UserState `encode_state` wrote; ValueError if the bytes do not have its layout."""
    if len(blob) < 8 * _HEADER:
        raise ValueError(f"stored user state is {len(blob)} bytes, shorter than its header")
    n_emb, n_ids, n_nb, width, n_handle = (int(x) for x in np.frombuffer(blob, "<i8", _HEADER))
    sizes = (4 * n_emb, 8 * n_ids, 4 * n_nb * width, n_handle, 8)
    if min(n_emb, n_ids, n_nb, width, n_handle) < 0 or (n_nb and not width) or len(blob) != 8 * _HEADER + sum(sizes):
        raise ValueError(f"stored user state of {len(blob)} bytes does not match its header "
                         f"{[n_emb, n_ids, n_nb, width, n_handle]}")
    at = 8 * _HEADER
    parts = []
    for size in sizes:
        parts.append(blob[at : at + size])
        at += size
    emb, ids, nb, handle, offset = parts
    return UserState(np.frombuffer(emb, "<f4").astype(np.float32), np.frombuffer(ids, "<i8").astype(np.int64),
                     np.frombuffer(nb, "<f4").astype(np.float32).reshape(n_nb, width), handle.hex(),
                     float(np.frombuffer(offset, "<f8")[0]))


def user_state_problem(st: UserState, *, dim: int, num_items: int, own: np.ndarray, min_rows: int, whole_table: bool,
                       max_neighbours: int, offset: bool) -> str | None:
    """Why a stored state cannot be this user's in this run, or None: checked when a run resumes from stored
    states, which may be damaged or another run's. `own`: the user's rated items (train and test), which its
    anonymity set must hold; `min_rows`: the smallest set the server registers (whole_table: none at all, the mode has
    no sets); `max_neighbours`: 0 when the run has no graph expansion; `offset`: whether the model keeps a user
    offset."""
    ids, nb = st.anonymity_ids, st.neighbours
    if st.embedding.shape != (dim,) or not np.isfinite(st.embedding).all():
        return f"an embedding of shape {st.embedding.shape}; expected {dim} finite values"
    if nb.ndim != 2 or nb.shape[1] != dim or nb.shape[0] > max_neighbours or not np.isfinite(nb).all():
        return f"neighbours of shape {nb.shape}; expected at most {max_neighbours} finite rows of width {dim}"
    if len(st.handle) != 2 * HANDLE_BYTES:
        return f"a handle of {len(st.handle) // 2} bytes; expected {HANDLE_BYTES}"
    if not np.isfinite(st.offset) or (st.offset != 0.0 and not offset):
        return f"a user offset of {st.offset}; expected " + ("a finite number" if offset
                                                             else "0 (model.user_offset is off)")
    if whole_table:
        return (f"{ids.size} anonymity-set items; expected none (a privacy mode without anonymity sets)" if ids.size
                else None)
    if ids.size < min_rows or (ids.size and (ids[0] < 0 or ids[-1] >= num_items)) or (np.diff(ids) <= 0).any():
        return f"{ids.size} anonymity-set items; expected at least {min_rows} sorted distinct ids in [0, {num_items})"
    if not np.isin(own, ids, assume_unique=True).all():
        return "an anonymity set without some of the user's own items; expected all of them in it"
    return None
