"""One run's submissions as an inverted index, and the bytes each write costs before it is made.

A handle has a slot (its position in `handles`, `embeddings`, `token_ids`); a token an id (its
position in `postings`, the array of slots that submitted it). `Run.store` writes one submission
only if its upper-bound cost fits the run's storage budget, then counts what the objects kept
really occupy (`memory.obj_bytes`). The upper bound follows how CPython grows what the index is
made of: lists and dicts by the worst case right after a resize (`memory.list_bytes`,
`memory.dict_bytes`), a full `array.array` by 1/16 plus 8 slots (CPython's `array_resize`). So a
submit is refused (429) before anything is stored, and `stored_bytes` never passes `budget`.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field

import numpy as np

from .limits import RequestError
from .memory import (
    ARRAY_FIXED,
    ARRAY_OVERHEAD,
    INT_BYTES,
    TOKEN_STR_BYTES,
    array_bytes,
    dict_bytes,
    list_bytes,
    ndarray_bytes,
    obj_bytes,
)

RUN_FIXED_BYTES = 8192  # a Run object with its empty containers and secret


@dataclass(eq=False)
class Run:
    """One run's settings, credentials, storage budget and submissions, with the inverted index."""

    dim: int
    max_tokens: int
    max_neighbours: int
    updates: bool
    secret: str | None = field(repr=False)
    touched: float
    budget: int
    memory_requested: int | None = None
    match: str = "shared_items"  # matching.MATCHES: who a handle's neighbours are
    slot_of: dict[str, int] = field(default_factory=dict, repr=False)
    handles: list[str] = field(default_factory=list, repr=False)
    embeddings: list[np.ndarray] = field(default_factory=list, repr=False)
    token_ids: list[np.ndarray] = field(default_factory=list, repr=False)
    token_id: dict[str, int] = field(default_factory=dict, repr=False)
    postings: list[array.array] = field(default_factory=list, repr=False)
    stored_bytes: int = RUN_FIXED_BYTES

    def containers(self) -> tuple:
        """The containers whose own size grows with the run (their items are counted separately)."""
        return self.slot_of, self.handles, self.embeddings, self.token_ids, self.token_id, self.postings

    def store(self, run_id: str, handle: str, emb: np.ndarray, toks: list[str], max_entries: int) -> None:
        """Write one validated submission (distinct tokens) if its upper-bound cost fits the budget.

        A handle already stored is left alone when the same submission comes again (a retry after a
        lost reply), updated when the run takes updates, refused (409) otherwise. Raises RequestError
        (429) when the run is full or its budget cannot take the write.
        """
        slot = self.slot_of.get(handle)
        known = [self.token_id.get(t) for t in toks]
        if slot is not None:
            old = self.token_ids[slot]
            if None not in known and np.array_equal(np.sort(np.asarray(known, np.int32)), old):
                if np.array_equal(self.embeddings[slot], emb):
                    return  # the same submission again: already stored
                if self.updates:  # trainable expansion: the same items, a new embedding
                    self.embeddings[slot][:] = emb
                    return
            if not self.updates:
                raise RequestError("this handle has already submitted to this run", 409)
        elif len(self.handles) >= max_entries:
            raise RequestError(f"run is full ({max_entries} handles)", 429)
        new = [t for t, i in zip(toks, known) if i is None]
        old_ids = set(self.token_ids[slot].tolist()) if slot is not None else set()
        added = [i for i in known if i is not None and i not in old_ids]
        cost = self._cost(slot, len(toks), new, added)
        if self.stored_bytes + cost > self.budget:
            raise RequestError(f"run '{run_id}' storage budget exhausted: {self.stored_bytes} of its {self.budget} "
                               f"bytes used, this submit needs up to {cost} more", 429)
        self._apply(slot, handle, emb, toks, new, added, old_ids, known)

    def _cost(self, slot: int | None, n_toks: int, new: list[str], added: list[int]) -> int:
        """Upper bound of the bytes a write adds: new objects, plus the growth of every container it appends to."""
        n_handles = len(self.handles) + (slot is None)
        n_tokens = len(self.token_id) + len(new)
        cost = ndarray_bytes(n_toks) - (obj_bytes(self.token_ids[slot]) if slot is not None else 0)
        if slot is None:
            cost += TOKEN_STR_BYTES + INT_BYTES + ndarray_bytes(self.dim)
            cost += max(0, dict_bytes(n_handles) - obj_bytes(self.slot_of))
            cost += sum(max(0, list_bytes(n_handles) - obj_bytes(c))
                        for c in (self.handles, self.embeddings, self.token_ids))
        if new:
            cost += len(new) * (TOKEN_STR_BYTES + INT_BYTES + array_bytes(1))
            cost += max(0, dict_bytes(n_tokens) - obj_bytes(self.token_id))
            cost += max(0, list_bytes(n_tokens) - obj_bytes(self.postings))
        for i in added:  # a posting array that is full grows by 1/16 (CPython's array_resize), at most +8 slots
            buffer, n = sys.getsizeof(self.postings[i]) - ARRAY_FIXED, len(self.postings[i]) + 1
            if 4 * n > buffer:
                cost += 4 * (n + (n >> 4) + 8) - buffer
        return cost

    def _apply(self, slot: int | None, handle: str, emb: np.ndarray, toks: list[str], new: list[str],
               added: list[int], old_ids: set[int], known: list[int | None]) -> None:
        """Make the write, adding to `stored_bytes` what the kept objects really occupy."""
        size, postings = sys.getsizeof, self.postings
        before = sum(obj_bytes(c) for c in self.containers()) + sum(size(postings[i]) for i in added)
        delta = 0
        if slot is None:
            slot = len(self.handles)
            self.slot_of[handle] = slot
            self.handles.append(handle)
            self.embeddings.append(emb)
            self.token_ids.append(np.zeros(0, np.int32))
            delta += obj_bytes(handle) + INT_BYTES + obj_bytes(emb)
        else:
            self.embeddings[slot][:] = emb
            for i in old_ids.difference(i for i in known if i is not None):  # an update replaces the old entry
                was = size(postings[i])
                postings[i].remove(slot)
                delta += size(postings[i]) - was
            delta -= obj_bytes(self.token_ids[slot])
        for t in new:
            self.token_id[t] = len(postings)
            added.append(len(postings))
            postings.append(array.array("i"))
            delta += TOKEN_STR_BYTES + INT_BYTES + ARRAY_OVERHEAD  # + its array, below
        for i in added:
            postings[i].append(slot)
        ids = np.fromiter((self.token_id[t] for t in toks), np.int32, len(toks))
        ids.sort()
        self.token_ids[slot] = ids
        delta += obj_bytes(ids) + sum(size(postings[i]) for i in added)
        delta += sum(obj_bytes(c) for c in self.containers()) - before
        self.stored_bytes += delta
