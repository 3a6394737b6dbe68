"""A rating split's centralized baselines: what a FedGNN model must beat to have learned anything.

    python -m benchmarks.baselines --dataset ml-100k douban --data-dir DATA [--out benchmarks/results/baselines.json]

For each registry dataset (or `synthetic`, the embedded default), the test RMSE of the global mean,
each user's mean, each item's mean and the regularised bias model (global mean + user bias + item
bias, ten alternating passes of regularised means; `fedrec_flwr.reference.baselines`), all fitted on the
whole training split, no federation, no privacy, predictions clipped to the dataset's scale.
Merges into the JSON record, keyed by dataset.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

from benchmarks.common import add_data_dir, markdown_table
from fedrec_flwr.cli.runner import input_errors_exit
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.reference.baselines import baseline_rmses, best_trivial


def dataset_baselines(dataset: str, data_dir: str) -> dict:
    """The baselines of one dataset's FedGNN split (as `fedgnn_tuned` loads it), with its size and scale."""
    cfg = load_config("fedgnn_tuned", dataset, [f"data.data_dir={data_dir}"])
    ds = UserPartitions(prepare_partitions(cfg.data)).ratings()
    rmses = baseline_rmses(ds)
    return {"users": ds.num_users, "items": ds.num_items, "train": len(ds.train), "test": len(ds.test),
            "scale": [ds.scale.low, ds.scale.high, ds.scale.step], "rmse": rmses, "best_trivial": best_trivial(rmses)}


def main() -> None:
    """Compute every requested dataset's baselines, print a table, merge them into the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", nargs="+", default=["synthetic"])
    add_data_dir(ap)
    ap.add_argument("--out", default="benchmarks/results/baselines.json")
    args = ap.parse_args()
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {"datasets": {}}
    rows = []
    with input_errors_exit():
        for name in args.dataset:
            row = {**dataset_baselines(name, args.data_dir), "date": date.today().isoformat()}
            record["datasets"][name] = row
            r = row["rmse"]
            rows.append([name, r["global_mean"], r["user_mean"], r["item_mean"], r["bias"]])
    print(markdown_table(["dataset", "global mean", "user mean", "item mean", "bias model"], rows))
    atomic_write(out, json.dumps(record, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
