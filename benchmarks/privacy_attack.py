"""Can the server tell a user's real item rows from its pseudo rows? Within-upload AUC per feature.

    python -m benchmarks.privacy_attack [--dim 256] [--users 60]

For each user of a small synthetic dataset the client builds one real upload; the attacker
ranks that upload's rows by each feature and we report the mean AUC over users (0.5 is
chance), for: the full protection (pseudo rows + LDP), pseudo rows without LDP, and a
strawman whose pseudo rows are zeros (the attack's power). Writes
benchmarks/results/privacy_attack.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy import stats

from clients.fedgnn_user import build_upload, init_user_state, local_gradients
from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.models import build_model

FEATURES = ("l2 norm", "l1 norm", "max |x|", "mean", "projection on mean row", "|top principal component|", "standardised distance")


def row_features(rows: np.ndarray) -> np.ndarray:
    """What an attacker can compute per row of one upload: norms, extremes, mean, projections, outlyingness."""
    centred = rows - rows.mean(0)
    top = np.linalg.svd(centred, full_matrices=False)[2][0]
    scale = centred.std(0) + 1e-12
    return np.stack([
        np.linalg.norm(rows, axis=1), np.abs(rows).sum(1), np.abs(rows).max(1), rows.mean(1),
        rows @ rows.mean(0), np.abs(centred @ top), np.square(centred / scale).sum(1),
    ], 1)


def within_upload_auc(cfg, users: int, mode: str) -> np.ndarray:
    """Mean over users of the AUC of 'real rows score higher', per feature, folded after averaging.

    mode: "protected" (as configured), or "zeros" (pseudo rows left at zero, no LDP).
    """
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
    aucs = []
    for u in range(min(users, meta.num_users)):
        data = parts.user(u)
        if data.train_items.size < 3:
            continue
        state = init_user_state(cfg, meta, data)
        rng = np.random.default_rng(u)
        rows = (rng.standard_normal((state.anonymity_ids.size, cfg.model.dim)) * 0.1).astype(np.float32)
        grads, real_rows, _, _ = local_gradients(cfg, model, state, data, rows, rng)
        is_real = np.isin(state.anonymity_ids, data.train_items)
        if mode == "zeros":
            up = np.zeros((state.anonymity_ids.size, cfg.model.dim), np.float32)
            up[is_real] = real_rows
        else:
            up = build_upload(cfg, state, data, grads, real_rows, rng)[-1]
        feats = row_features(up)
        aucs.append([stats.mannwhitneyu(feats[is_real, j], feats[~is_real, j]).statistic / (is_real.sum() * (~is_real).sum())
                     for j in range(feats.shape[1])])
    mean = np.mean(aucs, axis=0)
    return np.maximum(mean, 1 - mean)


def main() -> None:
    """Measure the three settings and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--users", type=int, default=60)
    ap.add_argument("--out", default="benchmarks/results/privacy_attack.json")
    args = ap.parse_args()
    base = [f"model.dim={args.dim}", "data.synthetic.num_users=60", "data.synthetic.num_items=200",
            "data.synthetic.mean_degree=15", "privacy.pseudo_items=100", "data.cache_dir=.cache/fedrec"]
    settings = {
        "pseudo rows + LDP (default)": (load_config("fedgnn", "synthetic", base), "protected"),
        "pseudo rows, no LDP": (load_config("fedgnn", "synthetic", [*base, "privacy.ldp=false"]), "protected"),
        "zeros for pseudo rows, no LDP": (load_config("fedgnn", "synthetic", [*base, "privacy.ldp=false"]), "zeros"),
    }
    out = {}
    for name, (cfg, mode) in settings.items():
        auc = within_upload_auc(cfg, args.users, mode)
        out[name] = dict(zip(FEATURES, map(float, auc)))
        print(f"{name:32s} max AUC {auc.max():.3f}  " + "  ".join(f"{f}={a:.3f}" for f, a in zip(FEATURES, auc)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dim": args.dim, "users": args.users, "auc": out}, indent=1))


if __name__ == "__main__":
    main()
