"""Who a handle's neighbours are: the handles sharing the most tokens with it, or handles drawn at random.

`shared_items` is the paper's graph expansion: it counts, over the run's inverted index, how many
tokens each other handle shares with the asking one, and keeps the N with the most (ties by
handle, so an answer does not depend on submission order). `random_others` is a control: N other
handles whatever they rated, to measure what shared items add to neighbours at all. Both run
under the service's lock, one at a time; `working_bytes` is what one such computation may take,
reserved once from the memory budget.
"""

from __future__ import annotations

import heapq
import secrets

import numpy as np

from .runs import Run

MATCHES = ("shared_items", "random")  # a run's `match` setting
MATCH_CHUNK = 1 << 18  # postings counted per numpy pass while matching
_SYSTEM_RANDOM = secrets.SystemRandom()


def working_bytes(max_entries: int, max_tokens: int, max_neighbours: int, max_dim: int) -> int:
    """Upper bound of one matching computation's arrays (counts, chunk, reply rows) under these limits."""
    chunk = min(MATCH_CHUNK + max_entries, max_tokens * max_entries)
    return 40 * max_entries + 4 * chunk + 8 * max_neighbours * max_dim


def neighbour_slots(run: Run, slot: int) -> list[int]:
    """The slots of `slot`'s neighbours under the run's `match` setting (at most its max_neighbours)."""
    return shared_items(run, slot) if run.match == "shared_items" else random_others(run, slot)


def random_others(run: Run, slot: int) -> list[int]:
    """At most N other slots drawn uniformly without replacement from the system RNG, whatever they rated."""
    others = len(run.handles) - 1
    picks = _SYSTEM_RANDOM.sample(range(others), min(run.max_neighbours, others))
    return [p + (p >= slot) for p in picks]  # skip the asking slot itself


def shared_items(run: Run, slot: int) -> list[int]:
    """Slots sharing a token with `slot`: most shared tokens first, then by handle; at most N."""
    n = len(run.handles)
    counts = np.zeros(n, np.int64)
    views: list[np.ndarray] = []
    try:  # views export the arrays' buffers: drop them before anyone appends again
        size = 0
        for i in run.token_ids[slot].tolist():
            if len(run.postings[i]):
                views.append(np.frombuffer(run.postings[i], np.int32))
                size += len(views[-1])
            if size >= MATCH_CHUNK:
                counts += np.bincount(np.concatenate(views), minlength=n)
                views.clear()
                size = 0
        if views:
            counts += np.bincount(np.concatenate(views), minlength=n)
    finally:
        views.clear()
    counts[slot] = 0
    cand = np.flatnonzero(counts)
    cap = run.max_neighbours
    if cand.size > cap:
        c = counts[cand]
        kth = np.partition(c, c.size - cap)[c.size - cap]  # the N-th largest count
        above = cand[c > kth].tolist()
        tied = heapq.nsmallest(cap - len(above), cand[c == kth].tolist(), key=run.handles.__getitem__)
        cand = above + tied
    else:
        cand = cand.tolist()
    return sorted(cand, key=lambda s: (-int(counts[s]), run.handles[s]))
