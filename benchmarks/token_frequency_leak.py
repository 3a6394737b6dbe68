"""What the neighbour service learns from token frequencies: items re-identified by popularity rank.

    python -m benchmarks.token_frequency_leak --data-dir ../shared/data

The service sees how many users submitted each (keyed) token. An attacker who knows item
popularity from auxiliary data ranks tokens by count and items by popularity and pairs them.
We report the fraction of tokens paired with their true item (ties broken at random) when the
auxiliary popularity is (a) the exact training counts (worst case) and (b) another split of the
same catalogue (ML-100K u2.base against u1.base, a realistic public copy), plus the random-guess
baseline. The attack is `fedrec_flwr.audit.attacks.popularity_reidentification`; this is its
command line. Writes benchmarks/results/token_frequency_leak.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.common import add_data_dir
from fedrec_flwr.audit.attacks import popularity_reidentification
from fedrec_flwr.data.loaders import load_split_files
from fedrec_flwr.data.types import RatingScale


def main() -> None:
    """Measure on ML-100K and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--out", default="benchmarks/results/token_frequency_leak.json")
    args = ap.parse_args()
    root = Path(args.data_dir) / "ml-100k"
    scale = RatingScale(1, 5, 1)
    u1 = load_split_files("u1", root / "u1.base", root / "u1.test", "\t", scale)
    u2 = load_split_files("u2", root / "u2.base", root / "u2.test", "\t", scale)
    n = max(u1.num_items, u2.num_items)
    observed = np.bincount(u1.train.items, minlength=n).astype(float)
    other = np.bincount(u2.train.items, minlength=n).astype(float)
    rng = np.random.default_rng(0)
    result = {
        "items_with_tokens": int((observed > 0).sum()),
        "exact_popularity": popularity_reidentification(observed, observed, rng),
        "exact_popularity_top100": popularity_reidentification(observed, observed, rng, 100),
        "other_split_popularity": popularity_reidentification(observed, other, rng),
        "other_split_popularity_top100": popularity_reidentification(observed, other, rng, 100),
        "random_guess": 1.0 / int((observed > 0).sum()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
