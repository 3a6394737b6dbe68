"""Where FPPDM's gain goes on a multi-domain dataset: accuracy of shared against one-domain users, and how
far the barycenter moves a shared user.

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.fppdm_overlap \
        --dataset douban-book-music --data-dir ../shared/data --seed 0

Variants: single_domain, and fppdm with fppdm.training.lambda_p at 0 (fppdm_lp0), its default (fppdm)
and 4x its default (fppdm_lp4x); `--only NAME ...` runs some of them.
Every other setting comes from the config files (the preset and `conf/datasets/<dataset>.yaml`,
section `algorithms.fppdm`), and from `--set key=value ...` overrides given to every variant (e.g. a
short schedule on `--dataset synthetic-md2`). Each variant runs its `federation.rounds` rounds in this process, without
Flower: every domain's `DomainTrainer.train` towards what the round core (`FPPDMRounds`) sends it, its
users' (ids, mu, sigma) back to the round core, which validates them and computes the barycenters.

After the last round, for every domain:
- HR@K and NDCG@K (leave-one-out, the project's sampled negatives and seed) over all its test users, over
  those also present in another domain ("shared") and over those present only in it ("only here");
- the shared users' HR@K and NDCG@K when each is ranked by its barycenter (the global user distribution)
  instead of its own domain's view ("shared_ranked_by_barycenter");
- the mean over shared users of W2(the user's local Gaussian, its barycenter) beside two scales of the
  domain's user space: the mean W2 between two of its users (all pairs) and the mean W2 from a user to
  its nearest other user. For single_domain the barycenter is computed but never sent: the distance is
  then that of two independently trained, unaligned user spaces.

Writes benchmarks/results/fppdm_overlap_seed<S>.json and prints markdown tables; `--summarise FILE ...`
prints the summary over seeds of files already written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_data_dir, add_resume, results_file
from fedrec_flwr.config import AppConfig, load_config, parse_overrides
from fedrec_flwr.data import MultiDomainDataset, load_multidomain
from fedrec_flwr.fppdm.analysis import space_scale, user_ranks, w2
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer, rank_metrics
from fedrec_flwr.fppdm.rounds import FPPDMRounds
from fedrec_flwr.messages import NodeReply

RESULTS = Path(__file__).parent / "results"  # fppdm_overlap_seed<S>.json


def variants(dataset: str, overrides: list[str]) -> dict[str, AppConfig]:
    """The runs compared: single_domain, and fppdm at lambda_p 0 (fppdm_lp0), its default (fppdm) and 4x it
    (fppdm_lp4x)."""
    base = load_config("fppdm", dataset, overrides)
    lam = base.fppdm.training.lambda_p
    return {"single_domain": load_config("single_domain", dataset, overrides),
            "fppdm_lp0": load_config("fppdm", dataset, [*overrides, "fppdm.training.lambda_p=0"]),
            "fppdm": base,
            "fppdm_lp4x": load_config("fppdm", dataset, [*overrides, f"fppdm.training.lambda_p={4 * lam!r}"])}


def group_metrics(ranks: np.ndarray, topk: list[int]) -> dict[str, float]:
    """Users and HR@K / NDCG@K of one group of test users' ranks."""
    out = rank_metrics(ranks, topk)
    return {"users": out.pop("n"), **out}


def run_variant(cfg: AppConfig, ds: MultiDomainDataset) -> dict:
    """Train one variant's rounds in-process through the round core; per-domain split metrics and distances."""
    f, t0 = cfg.fppdm, time.time()
    trainers = [DomainTrainer(DomainData(dom), k, f.model, f.training, f.coclustering, cfg.seed)
                for k, dom in enumerate(ds.domains)]
    rounds = FPPDMRounds.from_config(cfg, ds.num_users, None, len(trainers))  # node id = domain index
    empty = [np.zeros(0, np.int64), np.zeros((0, f.model.dim), np.float32), np.zeros((0, f.model.dim), np.float32)]
    for rnd in range(1, cfg.federation.rounds + 1):
        started, replies = time.time(), []
        for k, tr in enumerate(trainers):
            sent = rounds.download(k) or empty
            tr.train(rnd, np.asarray(sent[0], np.int64), np.asarray(sent[1], np.float32),
                     np.asarray(sent[2], np.float32))
            mu, sigma = tr.user_distributions()
            replies.append(NodeReply(k, [tr.data.global_ids.astype(np.int64), mu, sigma]))
        record = rounds.train(rnd, replies, [], started)
        if record["accepted"] != len(trainers):
            raise RuntimeError(f"round {rnd}: the round core refused {len(trainers) - record['accepted']} uploads")
    train_seconds = time.time() - t0
    evals = [NodeReply(k, metrics={**tr.evaluate(f.evaluation), "domain": tr.data.name})
             for k, tr in enumerate(trainers)]
    mean = rounds.evaluate(cfg.federation.rounds, evals)  # the number a flwr run reports (mean over domains)
    glob = rounds.global_users
    domains = {}
    for k, tr in enumerate(trainers):
        d = tr.data
        others = np.concatenate([o.data.global_ids for j, o in enumerate(trainers) if j != k]
                                or [np.zeros(0, np.int64)])
        shared_row = np.isin(d.row_ids, others)  # per user row: present in another domain too
        shared_user = shared_row[: d.num_uploaded]  # ... among the users this domain trains and uploads
        ranks, test_shared = user_ranks(tr, f.evaluation), shared_row[d.test_users]
        mu, sigma = tr.user_distributions()  # what this domain uploaded in the last round
        pos = np.searchsorted(glob.ids, d.global_ids[shared_user])
        moved = w2(mu[shared_user], sigma[shared_user], glob.mu[pos], glob.sigma[pos])
        scale = space_scale(mu, sigma)
        # the global user distribution at evaluation: shared users ranked by their barycenter, not their local view
        by_barycenter = user_ranks(tr, f.evaluation, (np.flatnonzero(shared_user), glob.mu[pos], glob.sigma[pos]))
        domains[d.name] = {
            "users": d.num_uploaded, "shared_users": int(shared_user.sum()),
            "all": group_metrics(ranks, f.evaluation.topk),
            "shared": group_metrics(ranks[test_shared], f.evaluation.topk),
            "only_here": group_metrics(ranks[~test_shared], f.evaluation.topk),
            "shared_ranked_by_barycenter": group_metrics(by_barycenter[test_shared], f.evaluation.topk),
            "shared_to_barycenter_w2": float(moved.mean()) if moved.size else float("nan"),
            "shared_to_barycenter_w2_median": float(np.median(moved)) if moved.size else float("nan"),
            **scale,
            "barycenter_over_random_pair": float(moved.mean() / scale["random_pair_w2"]) if moved.size
                                           else float("nan"),
        }
    return {"lambda_p": f.training.lambda_p, "aggregate": f.server.aggregate, "mean_over_domains": mean,
            "domains": domains, "train_seconds": train_seconds, "wall_seconds": time.time() - t0}


def settings(cfg: AppConfig) -> dict:
    """The resolved sections a variant trains and evaluates with (recorded beside its numbers)."""
    return {"seed": cfg.seed, "federation": asdict(cfg.federation),
            **{f"fppdm.{k}": asdict(getattr(cfg.fppdm, k)) for k in ("model", "training", "coclustering", "server",
                                                                      "evaluation")}}


def markdown(results: dict[str, dict]) -> str:
    """The accuracy table (per variant, domain and user group) and the distance table, as markdown."""
    topk = sorted({int(k.split("@")[1]) for r in results.values() for k in r["mean_over_domains"]})
    head = " | ".join(f"HR@{k} | NDCG@{k}" for k in topk)
    lines = [f"| variant | domain | users | {head} |", "|---|---|---|" + "---|" * (2 * len(topk))]
    for name, r in results.items():
        lines.append(f"| {name} | mean over domains | | "
                     + " | ".join(f"{r['mean_over_domains'][f'hr@{k}']:.4f} | {r['mean_over_domains'][f'ndcg@{k}']:.4f}"
                                  for k in topk) + " |")
        for dom, m in r["domains"].items():
            for group in ("all", "shared", "only_here"):
                g = m[group]
                lines.append(f"| {name} | {dom} {group.replace('_', ' ')} | {g['users']} | "
                             + " | ".join(f"{g[f'hr@{k}']:.4f} | {g[f'ndcg@{k}']:.4f}" for k in topk) + " |")
    lines += ["", "| variant | domain | shared users | W2 to barycenter (mean / median) | random-pair W2 | "
                  "nearest-user W2 | barycenter / random pair |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for dom, m in r["domains"].items():
            lines.append(f"| {name} | {dom} | {m['shared_users']} | {m['shared_to_barycenter_w2']:.4f} / "
                         f"{m['shared_to_barycenter_w2_median']:.4f} | {m['random_pair_w2']:.4f} | "
                         f"{m['nearest_user_w2']:.4f} | {m['barycenter_over_random_pair']:.3f} |")
    return "\n".join(lines)


def seed_summary(docs: list[dict]) -> str:
    """Markdown: over the seeds of `docs` (one fppdm_overlap JSON each), every variant's mean HR@5 and, per
    domain and user group, its HR@5 minus single_domain's (mean +- std of the per-seed differences); where
    recorded, its shared users' HR@5 when ranked by their barycenter minus by their own view; and the mean
    W2 from a shared user to its barycenter."""
    def pm(values: list[float], signed: bool = False) -> str:
        mean, std = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{mean:+.4f} ± {std:.4f}" if signed else f"{mean:.4f} ± {std:.4f}"

    names = [n for n in docs[0]["variants"] if all(n in d["variants"] for d in docs)]
    domains = list(docs[0]["variants"][names[0]]["domains"])
    groups = [(dom, g) for dom in domains for g in ("shared", "only_here")]
    head = " | ".join(f"Δ HR@5, {dom} {g.replace('_', ' ')}" for dom, g in groups)
    by_bary = all("shared_ranked_by_barycenter" in m for d in docs for v in d["variants"].values()
                  for m in v["domains"].values())
    extra = "".join(f" Δ HR@5, {dom} shared ranked by barycenter |" for dom in domains) if by_bary else ""
    lines = [f"seeds {sorted(d['seed'] for d in docs)}", "",
             f"| variant | mean HR@5 | {head} |{extra} W2 shared user to barycenter |",
             "|---|---|" + "---|" * (len(groups) + (len(domains) if by_bary else 0)) + "---|"]
    for name in names:
        runs = [d["variants"][name] for d in docs]
        base = [d["variants"]["single_domain"] for d in docs]
        cells = [pm([r["domains"][dom][g]["hr@5"] - b["domains"][dom][g]["hr@5"] for r, b in zip(runs, base)], True)
                 for dom, g in groups]
        if by_bary:  # the same variant's shared users, ranked by their barycenter instead of their own view
            cells += [pm([r["domains"][dom]["shared_ranked_by_barycenter"]["hr@5"] - r["domains"][dom]["shared"]["hr@5"]
                          for r in runs], True) for dom in domains]
        w2 = pm([r["domains"][domains[0]]["shared_to_barycenter_w2"] for r in runs])
        lines.append(f"| {name} | {pm([r['mean_over_domains']['hr@5'] for r in runs])} | {' | '.join(cells)} | {w2} |")
    return "\n".join(lines)


def main() -> None:
    """CLI: run every variant in turn, print the tables and write the JSON (or, with --summarise, the
    seed summary of JSONs already written)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="douban-book-music")
    add_data_dir(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=None, help="names of the variants to run (default: all)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every variant")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/fppdm_overlap_seed<S>.json")
    add_resume(ap)
    ap.add_argument("--summarise", nargs="+", type=Path, default=None, metavar="JSON",
                    help="print the seed summary of these result files instead of running")
    args = ap.parse_args()
    if args.summarise:
        print(seed_summary([json.loads(f.read_text()) for f in args.summarise]))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.time()
    configs = variants(args.dataset, [f"data.data_dir={args.data_dir}", f"seed={args.seed}",
                                      *parse_overrides(" ".join(args.set))])
    if args.only:
        if unknown := sorted(set(args.only) - set(configs)):
            ap.error(f"unknown variants {unknown}; choose from {list(configs)}")
        configs = {k: v for k, v in configs.items() if k in args.only}
    ds = load_multidomain(next(iter(configs.values())).data)  # the variants differ only in FPPDM settings
    results = {}
    for name, cfg in configs.items():
        results[name] = run_variant(cfg, ds)
        print(f"[fppdm_overlap] {name}: {results[name]['mean_over_domains']} ({results[name]['wall_seconds']:.0f}s)",
              flush=True)
    table = markdown(results)
    print(table)
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([*(["OMP_NUM_THREADS=" + os.environ["OMP_NUM_THREADS"]]
                                  if "OMP_NUM_THREADS" in os.environ else []),
                                "python -m benchmarks.fppdm_overlap", *sys.argv[1:]]),
           "dataset": args.dataset, "seed": args.seed, "torch_threads": torch.get_num_threads(),
           "wall_seconds": time.time() - t0,
           "settings": {name: settings(cfg) for name, cfg in configs.items()},
           "variants": results, "table": table}
    path = results_file(args.out or RESULTS / f"fppdm_overlap_seed{args.seed}.json", args.resume)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"[fppdm_overlap] wrote {path} ({out['wall_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
