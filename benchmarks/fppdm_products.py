"""Where an FPPDM training step at the paper's settings spends its time, and which sparse product is fastest here.

    OMP_NUM_THREADS=2 python -m benchmarks.fppdm_products --data-dir DATA [--dataset amazon-phone-elec]
        [--batch 256] [--steps 30] [--repeats 7] [--threads 1]

Per domain, on the normalised adjacency A the model propagates with (float32, D = `fppdm.model.dim`):
- graph: nodes and non-zeros of A;
- reach: over `--steps` batches of `--batch` interactions, the share of the nodes each propagation layer is
  needed on (`RowPlan`), and the non-zeros one step multiplies per table (mu or sigma), forward and
  backward, counted in whole-graph products (A @ X is one);
- kernels: one whole-graph product, ms (median of `--repeats`): scipy CSR on one table (what row
  propagation runs), torch CSR at 1 and 2 threads, mu and sigma stacked into one [n, 2D] product (scipy;
  torch at 1 and 2 threads), mu and sigma as two scipy products on two threads (today's path with 2
  threads), and scipy on the graph reordered by reverse Cuthill-McKee (locality);
- step: `--steps` training steps of `DomainTrainer.train` at `--batch` under cProfile (torch at
  `--threads`): ms per step, and at one thread the shares of the sparse products, Adam, the products'
  output zero-fill and the rest (with two, the products run on threads cProfile does not see);
- floor: the step's products at the fastest exact kernel plus Adam, everything else free; the paper
  round (`--epochs` local epochs over all interactions) at the measured step and at that floor.
Writes benchmarks/results/fppdm_products.json; prints tables.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.csgraph import reverse_cuthill_mckee

from benchmarks.common import add_data_dir, markdown_table
from fedrec_flwr.config import load_config
from fedrec_flwr.data import load_multidomain
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer, sample_training_negatives
from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.models.gaussian_gcn import RowPlan

OUT = Path("benchmarks/results/fppdm_products.json")


def median_ms(fn, repeats: int) -> float:
    """Median wall milliseconds of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def with_threads(n: int, fn):
    """fn run with torch at n threads (restored afterwards)."""
    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)
    return run


def reach(trainer: DomainTrainer, adj: sp.csr_matrix, batch: int, steps: int) -> dict:
    """Shares of the nodes per layer and the non-zeros one step multiplies per table, as `train` plans them."""
    d, rng = trainer.data, np.random.default_rng(0)
    layer_share, nnz = [], []
    for _ in range(steps):
        idx = rng.choice(d.users.size, size=min(batch, d.users.size), replace=False)
        users, pos = d.users[idx], d.items[idx]
        neg = sample_training_negatives(rng, d, users)
        nodes = np.unique(np.concatenate([users, pos + d.num_users, neg + d.num_users]))
        plan = RowPlan(adj, trainer.model.layers, nodes)
        # layer k's output rows: block k's rows (the whole graph where the plan widened to it)
        layer_share.append([plan.blocks[k].shape[0] / adj.shape[0] for k in range(1, plan.layers + 1)])
        nnz.append(sum(plan.blocks[k].nnz for k in range(1, plan.layers + 1)))
    fwd = float(np.mean(nnz)) / adj.nnz
    return {"layer_node_share": np.mean(layer_share, axis=0).round(3).tolist(),
            "products_forward_per_table": round(fwd, 3), "products_per_step_per_table": round(2 * fwd, 3)}


def kernels(adj_t: torch.Tensor, adj: sp.csr_matrix, dim: int, repeats: int) -> dict:
    """Milliseconds of one whole-graph product per kernel (see the module docstring)."""
    n = adj.shape[0]
    rng = np.random.default_rng(0)
    mu, sigma = (rng.standard_normal((n, dim), dtype=np.float32) for _ in range(2))
    both = np.ascontiguousarray(np.concatenate([mu, sigma], axis=1))
    mu_t, both_t = torch.from_numpy(mu), torch.from_numpy(both)
    order = reverse_cuthill_mckee(adj, symmetric_mode=True)
    adj_rcm, mu_rcm = adj[order][:, order].tocsr(), np.ascontiguousarray(mu[order])
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        out = {
            "scipy, one table": median_ms(lambda: adj @ mu, repeats),
            "torch CSR 1 thread, one table": median_ms(with_threads(1, lambda: adj_t @ mu_t), repeats),
            "torch CSR 2 threads, one table": median_ms(with_threads(2, lambda: adj_t @ mu_t), repeats),
            "scipy RCM-reordered, one table": median_ms(lambda: adj_rcm @ mu_rcm, repeats),
            "scipy, mu and sigma stacked": median_ms(lambda: adj @ both, repeats),
            "torch CSR 1 thread, mu and sigma stacked": median_ms(with_threads(1, lambda: adj_t @ both_t), repeats),
            "torch CSR 2 threads, mu and sigma stacked": median_ms(with_threads(2, lambda: adj_t @ both_t), repeats),
            "scipy, mu and sigma on two threads": median_ms(lambda: list(pool.map(lambda x: adj @ x, (mu, sigma))),
                                                            repeats),
        }
    finally:
        pool.shutdown()
    return {k: round(v, 2) for k, v in out.items()}


def step_profile(cfg, domain, index: int, steps: int, batch: int) -> dict:
    """ms per training step and the shares of its parts, from cProfile over `steps` steps (after a warm-up round)."""
    f = cfg.fppdm
    trainer = DomainTrainer(DomainData(domain), index, f.model, f.training, f.coclustering, cfg.seed)
    keep = np.sort(np.random.default_rng(0).permutation(trainer.data.users.size)[: steps * batch])
    trainer.data.users, trainer.data.items = trainer.data.users[keep], trainer.data.items[keep]
    empty = np.zeros(0, np.int64), np.zeros((0, f.model.dim), np.float32), np.zeros((0, f.model.dim), np.float32)
    trainer.train(1, *empty)  # warm-up: Adam's state, the scipy copy of the adjacency
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    trainer.train(2, *empty)
    prof.disable()
    wall = time.perf_counter() - t0
    own = {}
    for (_, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        own[name] = own.get(name, 0.0) + tottime
    products = sum(v for k, v in own.items() if "csr_matvecs" in k or k == "<built-in method torch._C._sparse_addmm>")
    adam = sum(v for k, v in own.items() if "adam" in k)
    zeros = own.get("<built-in method numpy.zeros>", 0.0)
    steps_run = -(-trainer.data.users.size // batch)
    share = None  # with 2 threads the products run on the propagation's threads, which cProfile does not see
    if torch.get_num_threads() == 1:
        share = {"sparse products": round(products / wall, 3), "Adam": round(adam / wall, 3),
                 "output zero-fill": round(zeros / wall, 3), "rest": round(1 - (products + adam + zeros) / wall, 3)}
    return {"ms_per_step": round(1e3 * wall / steps_run, 1), "steps": steps_run, "share": share,
            "adam_ms_per_step": round(1e3 * adam / steps_run, 2)}


def main() -> None:
    """Measure every domain of the dataset, print the tables and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(ap)
    ap.add_argument("--dataset", default="amazon-phone-elec")
    ap.add_argument("--batch", type=int, default=256, help="the paper's batch")
    ap.add_argument("--epochs", type=int, default=5, help="the paper's local epochs per round")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the profiled steps")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("fppdm", args.dataset, [f"data.data_dir={args.data_dir}",
                                              f"fppdm.training.batch_size={args.batch}",
                                              "fppdm.training.local_epochs=1"])
    ds = load_multidomain(cfg.data)
    dim = cfg.fppdm.model.dim
    domains = {}
    for k, dom in enumerate(ds.domains):
        trainer = DomainTrainer(DomainData(dom), k, cfg.fppdm.model, cfg.fppdm.training, cfg.fppdm.coclustering,
                                cfg.seed)
        trainer.model.plan_rows(np.arange(1))  # builds the scipy copy of the adjacency
        adj, adj_t = trainer.model._adj_scipy, trainer.model.adj
        rec = {"nodes": int(adj.shape[0]), "nonzeros": int(adj.nnz), "interactions": int(trainer.data.users.size),
               "reach": reach(trainer, adj, args.batch, args.steps),
               "kernels_ms": kernels(adj_t, adj, dim, args.repeats)}
        rec["step"] = step_profile(cfg, dom, k, args.steps, args.batch)
        per_table = rec["reach"]["products_per_step_per_table"]
        kern = rec["kernels_ms"]
        one_thread = min(kern["scipy, one table"], kern["torch CSR 1 thread, one table"],
                         kern["scipy RCM-reordered, one table"])
        rec["floor_ms_per_step"] = {
            "1 thread": round(2 * per_table * one_thread + rec["step"]["adam_ms_per_step"], 1),
            "2 threads": round(per_table * min(kern["scipy, mu and sigma on two threads"],
                                               kern["torch CSR 2 threads, mu and sigma stacked"])
                               + rec["step"]["adam_ms_per_step"], 1)}
        paper_steps = args.epochs * -(-rec["interactions"] // args.batch)
        rec["paper_round_seconds"] = {"steps": paper_steps,
                                      "at the measured step": round(paper_steps * rec["step"]["ms_per_step"] / 1e3, 1),
                                      **{f"floor, {k}": round(paper_steps * v / 1e3, 1)
                                         for k, v in rec["floor_ms_per_step"].items()}}
        domains[dom.name] = rec
        print(f"[fppdm_products] {dom.name}: {json.dumps(rec)}", flush=True)
    print(markdown_table(["domain", "nodes", "non-zeros", "layer node share (1..L)", "products per step per table"],
                         [[n, r["nodes"], r["nonzeros"], r["reach"]["layer_node_share"],
                           r["reach"]["products_per_step_per_table"]] for n, r in domains.items()]))
    kinds = list(next(iter(domains.values()))["kernels_ms"])
    print(markdown_table(["whole-graph product (ms)", *domains], [[k, *(r["kernels_ms"][k] for r in domains.values())]
                                                                  for k in kinds]))
    print(markdown_table(["domain", "ms per step", "shares", "floor ms per step", "paper round s"],
                         [[n, r["step"]["ms_per_step"], r["step"]["share"], r["floor_ms_per_step"],
                           r["paper_round_seconds"]]
                          for n, r in domains.items()]))
    doc = json.loads(args.out.read_text()) if args.out.is_file() else {"runs": {}}
    doc["runs"][f"{args.dataset}/batch={args.batch}/threads={args.threads}"] = {
        "command": f"python -m benchmarks.fppdm_products --data-dir DATA --dataset {args.dataset} --batch {args.batch} "
                   f"--steps {args.steps} --repeats {args.repeats} --threads {args.threads}",
        "date": date.today().isoformat(),
        "machine": {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__},
        "dim": dim, "layers": cfg.fppdm.model.layers, "domains": domains}
    atomic_write(args.out, json.dumps(doc, indent=1) + "\n")
    print(f"[fppdm_products] wrote {args.out}")


if __name__ == "__main__":
    main()
