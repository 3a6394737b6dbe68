"""Deterministic synthetic data: planted low-rank ratings with power-law degrees.

The embedded default dataset, so `flwr run .` works offline on a fresh clone and
tests run without downloads. Ratings carry real structure (a model that learns
beats the global mean clearly) while sizes stay small enough for 2 CPU cores.
"""

from __future__ import annotations

import numpy as np

from fedrec_flwr.progress import Progress

from .types import Domain, MultiDomainDataset, RatingDataset, Ratings, RatingScale

SYNTHETIC_SCALE = RatingScale(1.0, 5.0, 1.0)
# data.synthetic.scale: the rating scales of the registry's datasets (1-5: ml-100k, douban, ml-1m;
# 0.5-5 in half steps: ml-10m, flixster; 1-100: yahoo_music), so scale handling is testable offline
SYNTHETIC_SCALES = {"1-5": SYNTHETIC_SCALE, "0.5-5": RatingScale(0.5, 5.0, 0.5), "1-100": RatingScale(1.0, 100.0, 1.0)}


def synthetic_scale(name: str) -> RatingScale:
    """The RatingScale a `data.synthetic.scale` name stands for; ValueError for an unknown name."""
    if name not in SYNTHETIC_SCALES:
        raise ValueError(f"synthetic scale {name!r}; expected one of {', '.join(SYNTHETIC_SCALES)}")
    return SYNTHETIC_SCALES[name]


def _quantise(signal: np.ndarray, scale: RatingScale) -> np.ndarray:
    """A continuous planted rating in reference units ([1, 5]) put on `scale`: mapped, rounded to its step, clipped."""
    if scale == SYNTHETIC_SCALE:  # the original 1-5 generator, bit for bit
        return np.clip(np.round(signal), 1, 5)
    raw = scale.from_units(signal)
    return np.clip(scale.low + np.round((raw - scale.low) / scale.step) * scale.step, scale.low, scale.high)


def _power_law_degrees(rng: np.random.Generator, n: int, mean: float, exponent: float, cap: int) -> np.ndarray:
    """Degrees from a Pareto tail with the requested mean, at least 3 and at most `cap`."""
    raw = rng.pareto(exponent - 1.0, size=n) + 1.0  # Pareto with x_min = 1
    deg = raw / raw.mean() * mean
    return np.clip(np.round(deg), 3, cap).astype(np.int64)


def _sample_interactions(
    rng: np.random.Generator, degrees: np.ndarray, item_weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each user draw `degree` distinct items, proportionally to popularity (Gumbel top-k)."""
    n_items = item_weights.shape[0]
    log_w = np.log(item_weights)
    users, items = [], []
    progress = Progress(degrees.size, "synthetic ratings (users)")
    for u, k in enumerate(degrees):
        keys = log_w + rng.gumbel(size=n_items)
        chosen = np.argpartition(-keys, k - 1)[:k]
        users.append(np.full(k, u, np.int64))
        items.append(np.sort(chosen).astype(np.int64))
        progress.update()
    progress.close()
    return np.concatenate(users), np.concatenate(items)


def make_synthetic(
    seed: int = 0,
    num_users: int = 600,
    num_items: int = 400,
    rank: int = 4,
    mean_degree: float = 40.0,
    degree_exponent: float = 2.2,
    noise_std: float = 0.25,
    test_fraction: float = 0.1,
    scale: str = "1-5",
) -> RatingDataset:
    """A rating dataset from r = clip(round(3.5 + b_u + b_i + u.v + noise)) on a 1-5 integer scale.

    `scale` ("1-5", "0.5-5" or "1-100", see SYNTHETIC_SCALES) puts the same planted ratings (same
    users, items, split and random draws) on another scale: the continuous value, in 1-5 units, is
    mapped affinely onto the scale and rounded to its step, so scale-invariant training can be checked
    without the real datasets. "1-5" gives the original data bit for bit.
    """
    rating_scale = synthetic_scale(scale)
    rng = np.random.default_rng(seed)
    cap = max(3, num_items // 2)
    degrees = _power_law_degrees(rng, num_users, mean_degree, degree_exponent, cap)
    popularity = rng.pareto(degree_exponent - 1.0, size=num_items) + 1.0
    users, items = _sample_interactions(rng, degrees, popularity)

    var = 0.9 / np.sqrt(rank)
    u_fac = rng.normal(0.0, np.sqrt(var), size=(num_users, rank))
    i_fac = rng.normal(0.0, np.sqrt(var), size=(num_items, rank))
    u_bias = rng.normal(0.0, 0.3, size=num_users)
    i_bias = rng.normal(0.0, 0.4, size=num_items)
    signal = 3.5 + u_bias[users] + i_bias[items] + np.einsum("nk,nk->n", u_fac[users], i_fac[items])
    values = _quantise(signal + rng.normal(0.0, noise_std, size=signal.shape), rating_scale)

    is_test = rng.random(users.shape[0]) < test_fraction
    # every user keeps at least one training rating: its first interaction never goes to test
    first = np.r_[True, users[1:] != users[:-1]]
    is_test &= ~first
    vals = values.astype(np.float32)
    ds = RatingDataset(
        name="synthetic",
        num_users=num_users,
        num_items=num_items,
        scale=rating_scale,
        train=Ratings(users[~is_test], items[~is_test], vals[~is_test]),
        test=Ratings(users[is_test], items[is_test], vals[is_test]),
        meta={"seed": seed, "rank": rank},
        item_features=_planted_genres(i_fac, np.sqrt(var)),
    )
    return ds.validate("synthetic")


def _planted_genres(i_fac: np.ndarray, sd: float) -> np.ndarray:
    """Public "genre" flags of the synthetic items: which latent factors are clearly positive or
    negative (2 x rank flags), scaled to sum 1 per item as the MovieLens loader does. They carry
    part of the planted taste structure, as real catalogue metadata does, and use no random draws,
    so asking for them changes no rating."""
    flags = np.concatenate([i_fac > 0.5 * sd, i_fac < -0.5 * sd], axis=1).astype(np.float32)
    return flags / np.maximum(flags.sum(1, keepdims=True), 1.0)


def make_synthetic_multidomain(
    seed: int = 0,
    num_domains: int = 3,
    num_users: int = 300,
    items_per_domain: int = 200,
    rank: int = 4,
    mean_degree: float = 15.0,
    overlap: float = 0.6,
) -> MultiDomainDataset:
    """K implicit domains sharing users whose tastes come from one latent factor per user.

    A fraction `overlap` of users appears in every domain; the others in one domain each,
    so users present in only some domains are exercised. Test: one held-out positive per user
    per domain (leave-one-out).
    """
    rng = np.random.default_rng(seed)
    u_fac = rng.normal(size=(num_users, rank))
    shared = rng.random(num_users) < overlap
    home = rng.integers(0, num_domains, size=num_users)
    domains = []
    for d in range(num_domains):
        i_fac = rng.normal(size=(items_per_domain, rank))
        present = np.flatnonzero(shared | (home == d))
        degrees = _power_law_degrees(rng, present.size, mean_degree, 2.2, items_per_domain // 3)
        tu, ti, su, si = [], [], [], []
        for u, k in zip(present, degrees):
            logits = i_fac @ u_fac[u] + rng.gumbel(size=items_per_domain)
            chosen = np.argpartition(-logits, k)[: k + 1]
            test_item, train_items = chosen[0], np.sort(chosen[1:])
            tu.append(np.full(train_items.size, u, np.int64))
            ti.append(train_items.astype(np.int64))
            su.append(u)
            si.append(int(test_item))
        domains.append(
            Domain(
                name=f"domain{d}",
                num_items=items_per_domain,
                train_users=np.concatenate(tu),
                train_items=np.concatenate(ti),
                test_users=np.asarray(su, np.int64),
                test_items=np.asarray(si, np.int64),
            )
        )
    return MultiDomainDataset(name=f"synthetic-md{num_domains}", num_users=num_users, domains=domains)
