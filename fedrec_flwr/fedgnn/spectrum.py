"""How much of FedGNN's item table stands above the noise: a diagnostic probe of in-process runs.

`spectrum_probe` plugs into `fedrec_flwr.cli.inprocess.run_in_process(cfg, probe=...)`: at every evaluation it
records the item table's singular values, how many of them exceed the Gavish-Donoho optimal hard
threshold (the components a matrix in i.i.d. noise lets one tell apart from that noise), and the RMSE when
every user evaluates against the table cut down to its top r singular directions (the same users and code
as the full table's RMSE). benchmarks/item_spectrum.py runs it with privacy on and off.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def gavish_donoho_threshold(singular_values: np.ndarray, shape: tuple[int, int]) -> float:
    """Optimal hard threshold for the singular values of an n x d matrix observed in i.i.d. noise of
    unknown level (Gavish & Donoho 2014): omega(beta) x median singular value, beta = min/max side."""
    beta = min(shape) / max(shape)
    omega = 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43
    return omega * float(np.median(singular_values))


def rank_cuts(table: np.ndarray, ranks: list[int]) -> dict[int, np.ndarray]:
    """The best rank-r approximation of `table` (Eckart-Young) for every r in `ranks`, from one SVD, as float32."""
    u, sv, vt = np.linalg.svd(np.asarray(table, np.float64), full_matrices=False)
    return {r: ((u[:, :r] * sv[:r]) @ vt[:r]).astype(np.float32) for r in ranks}


def spectrum_probe(ranks: list[int], keep_values: int = 40) -> Callable:
    """A `run_in_process` probe: at each evaluation, the item table's top `keep_values` singular values,
    the Gavish-Donoho threshold and the number of values above it (`gd_rank`), and the RMSE of every user
    against the table truncated to each rank in `ranks` (`rmse_at_rank`, keyed by the rank as text)."""
    def probe(server, rmse, device_user) -> dict:
        table = server.items.detach().cpu().numpy().astype(np.float64)
        sv = np.linalg.svd(table, compute_uv=False)
        threshold = gavish_donoho_threshold(sv, table.shape)
        at_rank = {str(r): rmse(cut) for r, cut in rank_cuts(table, ranks).items()}
        return {"singular_values": sv[:keep_values].round(4).tolist(), "gd_threshold": round(threshold, 4),
                "gd_rank": int((sv > threshold).sum()), "rmse_at_rank": at_rank}
    return probe
