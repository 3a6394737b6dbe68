"""Can the server pick a user's real items out of its anonymity set by popularity alone?

    python -m benchmarks.popularity_attack --data-dir DATA [--datasets ml-100k douban] [--preset fedgnn_tuned]

For each dataset and pseudo-item sampler (`uniform`: the paper's M pseudo items uniformly among the
unrated items; `popularity`: matched to the users' LDP popularity reports per stratum) the users
register through the same round core as `flwr run` (`fedrec_flwr.fedgnn.rounds`, in-process). The
server then ranks every received set by (a) how many received sets hold each item, which it always
knows, (b) the true training popularity, which a stronger server may have from public data, and (c)
each item's mean co-occurrence lift (or cosine) with the set's other items across the other sets.
Reported: mean per-user AUC (0.5 is chance), top-10 precision against the base rate (the real
share of a set), and the mean set size (rows per upload: the traffic). Writes
benchmarks/results/popularity_attack.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import add_data_dir
from fedrec_flwr.audit.attacks import registration_popularity_attack
from fedrec_flwr.config import load_config

SAMPLERS = ("uniform", "popularity")


def main() -> None:
    """Measure every (dataset, sampler) and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--datasets", nargs="+", default=["ml-100k", "douban"])
    ap.add_argument("--preset", default="fedgnn_tuned")
    ap.add_argument("--out", default="benchmarks/results/popularity_attack.json")
    args = ap.parse_args()
    results = {}
    for dataset in args.datasets:
        for sampler in SAMPLERS:
            cfg = load_config(args.preset, dataset,
                              [f"data.data_dir={args.data_dir}", f"privacy.pseudo_sampler={sampler}"])
            t0 = time.time()
            r = registration_popularity_attack(cfg)
            results[f"{dataset}/{sampler}"] = {"dataset": dataset, "sampler": sampler, **r,
                                               "settings": {k: getattr(cfg.privacy, k) for k in (
                                                   "pseudo_items", "pseudo_ratio", "popularity_bins",
                                                   "popularity_epsilon")}}
            obs, true = r["observed set counts"], r["true training popularity"]
            lift, cosine = r["co-occurrence lift"], r["co-occurrence cosine"]
            print(f"{dataset:8s} {sampler:10s} set {r['mean_set_size']:7.1f} rows | AUC observed {obs['auc']:.3f} "
                  f"true {true['auc']:.3f} lift {lift['auc']:.3f} cosine {cosine['auc']:.3f} | top-10 "
                  f"{obs['top_precision']:.2f}/{true['top_precision']:.2f} base {obs['base_rate']:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "date": time.strftime("%Y-%m-%d"),
                                          "results": results}, indent=1))


if __name__ == "__main__":
    main()
