"""Popularity-matched pseudo items: anonymity sets whose real items the server cannot rank out.

The attack. The server sees every user's anonymity set in the clear. Counting how often each item
appears across the sets (or using any public popularity figure) and ranking one user's set by that
count puts the real items first: with pseudo items drawn uniformly from the unrated items, popular
items are almost always real (`fedrec_flwr.audit.attacks.popularity_attack` measures it).

The defence. Items are cut into `bins` strata of equal size by a popularity every device knows, and
a user draws, in every stratum, `ratio` pseudo items per item of its own there (uniformly among its
unrated items of that stratum). Inside one set every stratum then holds real and pseudo items in the
same proportion 1 : ratio, so any score that is a function of popularity ranks them at chance.

Where the popularity comes from. Before registration every user sends one report of its items
through optimized unary encoding (OUE, Wang et al., USENIX Security 2017): one bit per catalogue
item, a bit of an own item kept at 1 with probability 1/2, any other bit set with probability
q = 1 / (e^eps + 1). Each bit is eps-LDP, so adding or removing one rating costs eps; changing a
user's whole rating set costs the composition over the catalogue's bits (`fedrec_flwr.fedgnn.accounting`).
The server sums the reports, debiases them into counts and publishes them; that is all it learns.

Limits, stated rather than hidden:
- items outside the set are revealed as unrated, and the set's size (about (1 + ratio) x the user's
  own items) reveals roughly how many items the user rated;
- the number of set items per stratum reveals how mainstream the user's items are (not which);
- a stratum the user has nearly exhausted (a heavy user of the most popular items) cannot hold
  `ratio` pseudo items per real one; its items keep more of their popularity signal;
- pseudo items are drawn independently of each other, so an attacker who models which items are
  rated together (co-occurrence, genres) is not defeated by this construction.
"""

from __future__ import annotations

import numpy as np


def oue_probabilities(epsilon: float) -> tuple[float, float]:
    """(P(report 1 | own item), P(report 1 | other item)) of optimized unary encoding at `epsilon`."""
    return 0.5, 1.0 / (np.exp(epsilon) + 1.0)


def oue_report(rng: np.random.Generator, own_items: np.ndarray, num_items: int, epsilon: float) -> np.ndarray:
    """One user's eps-LDP report of its items: uint8[num_items], every bit randomised on the device."""
    keep, flip = oue_probabilities(epsilon)
    draws = rng.random(num_items)
    bits = draws < flip
    own = np.asarray(own_items, np.int64)
    bits[own] = draws[own] < keep
    return bits.astype(np.uint8)


def check_report(bits: np.ndarray, num_items: int) -> np.ndarray:
    """A received report, checked: 1-D, one entry per catalogue item, every entry 0 or 1; ValueError otherwise."""
    bits = np.asarray(bits)
    if bits.shape != (num_items,):
        raise ValueError(f"popularity report has shape {bits.shape}, expected ({num_items},)")
    if not (np.issubdtype(bits.dtype, np.integer) or bits.dtype == bool):
        raise ValueError(f"popularity report must hold integers 0/1, got {bits.dtype}")
    if bits.size and (bits.min() < 0 or bits.max() > 1):
        raise ValueError("popularity report entries must be 0 or 1")
    return bits.astype(np.int64)


def estimate_counts(bit_sums: np.ndarray, reports: int, epsilon: float) -> np.ndarray:
    """Unbiased estimates of how many users have each item, from the sum of `reports` OUE reports."""
    keep, flip = oue_probabilities(epsilon)
    return ((np.asarray(bit_sums, np.float64) - reports * flip) / (keep - flip)).astype(np.float32)


def popularity_strata(counts: np.ndarray, bins: int) -> np.ndarray:
    """Stratum of every item (0 = most popular): items ranked by `counts` (ties by id), cut into `bins` equal runs."""
    counts = np.asarray(counts, np.float64)
    order = np.lexsort((np.arange(counts.size), -counts))
    rank = np.empty(counts.size, np.int64)
    rank[order] = np.arange(counts.size)
    bins = max(1, min(bins, counts.size))
    return rank * bins // max(counts.size, 1)


def inclusion_odds(counts: np.ndarray, users: int) -> np.ndarray:
    """q / (1 - q) per item, with q = count / users clipped into (0, 1): the odds that a user has the item."""
    q = np.clip(np.asarray(counts, np.float64), 0.5, max(users - 0.5, 1.0)) / max(users, 1)
    return q / (1.0 - q)


def sample_matched_pseudo(rng: np.random.Generator, own_items: np.ndarray, strata: np.ndarray, ratio: int,
                          weights: np.ndarray | None = None) -> np.ndarray:
    """Pseudo items, sorted: in each stratum `ratio` per own item there (as many as its unrated items allow).

    `weights` (the items' `inclusion_odds`): inside a stratum, an unrated item is drawn in proportion to
    the odds that a user has it, so a finer popularity than the strata' does not single out the real
    items either; None draws uniformly inside each stratum.

    A user without items draws `ratio + 1` items from the strata in proportion to their size, so
    its set looks like that of a user with one rating; a user whose strata are exhausted is topped up
    to `ratio` pseudo items from any unrated items (the server requires 1 + ratio ids per set).
    """
    num_items = strata.size
    own = np.asarray(own_items, np.int64)
    is_own = np.zeros(num_items, bool)
    is_own[own] = True
    if own.size == 0:
        return np.sort(rng.choice(num_items, size=min(ratio + 1, num_items), replace=False)).astype(np.int64)
    per_stratum = np.bincount(strata[own], minlength=int(strata.max()) + 1)
    picks = []
    for s in np.flatnonzero(per_stratum):
        pool = np.flatnonzero((strata == s) & ~is_own)
        if pool.size == 0:  # the user has every item of this stratum
            continue
        p = None if weights is None else weights[pool] / weights[pool].sum()
        picks.append(rng.choice(pool, size=min(pool.size, ratio * int(per_stratum[s])), replace=False, p=p))
    pseudo = np.concatenate(picks).astype(np.int64) if picks else np.zeros(0, np.int64)
    if pseudo.size < ratio:  # exhausted strata: top up from any unrated items, so every set has >= 1 + ratio ids
        is_own[pseudo] = True
        rest = np.flatnonzero(~is_own)
        pseudo = np.concatenate([pseudo, rng.choice(rest, size=min(ratio - pseudo.size, rest.size), replace=False)])
    return np.sort(pseudo)
