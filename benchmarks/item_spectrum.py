"""How much of FedGNN's item table stands above the LDP noise: singular values and truncated-table RMSE.

    python -m benchmarks.item_spectrum --dataset ml-100k --data-dir ../shared/data [--rounds 120]

Trains the `fedgnn_tuned` preset in-process (`fedrec_flwr.cli.inprocess`, the same user and server code as a
`flwr run`) once with privacy on and once with it off. At every evaluation it records the item
table's singular values, how many of them exceed the Gavish-Donoho optimal hard threshold (the
components a matrix in i.i.d. noise lets one tell apart from that noise), and the RMSE when every
user evaluates against the table cut down to its top r singular directions. If privacy-on RMSE
barely changes when the table keeps only a handful of directions, while privacy-off RMSE does,
the noise, not the model, decides what the private table can hold. The probe is
`fedrec_flwr.fedgnn.spectrum.spectrum_probe`. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import add_data_dir
from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import load_config, parse_overrides
from fedrec_flwr.fedgnn.spectrum import spectrum_probe

PRIVACY_OFF = ["privacy.ldp=false", "privacy.pseudo_items=0"]


def main(argv: list[str] | None = None) -> None:
    """CLI: run privacy on and off, print one line per evaluation, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fedgnn_tuned")
    ap.add_argument("--dataset", default="ml-100k")
    add_data_dir(ap)
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--privacy", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--set", nargs="*", default=[], help="further config overrides key=value")
    ap.add_argument("--out", default="benchmarks/results/item_spectrum.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    runs = []
    for privacy in args.privacy:
        overrides = [f"data.data_dir={args.data_dir}", f"federation.rounds={args.rounds}",
                     f"federation.eval_every={args.eval_every}", *parse_overrides(" ".join(args.set)),
                     *(PRIVACY_OFF if privacy == "off" else [])]
        cfg = load_config(args.preset, args.dataset, overrides)
        t0 = time.time()
        out = run_in_process(cfg, probe=spectrum_probe(args.ranks))
        evals = [h for h in out["history"] if "rmse" in h]
        for h in evals:
            cut = " ".join(f"r{r}={v:.4f}" for r, v in h["rmse_at_rank"].items())
            print(f"[spectrum] privacy {privacy} round {h['round']} rmse {h['rmse']:.4f} gd_rank {h['gd_rank']} "
                  f"top sv {h['singular_values'][:4]} | {cut}", flush=True)
        runs.append({"privacy": privacy, "overrides": overrides[1:], "wall_seconds": round(time.time() - t0, 1),
                     "evaluations": [{k: h[k] for k in ("round", "rmse", "gd_rank", "gd_threshold", "rmse_at_rank",
                                                          "singular_values")} for h in evals]})
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} thread",
              "command": "python -m benchmarks.item_spectrum " + shlex.join(sys.argv[1:] if argv is None else argv),
              "preset": args.preset, "dataset": args.dataset, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
