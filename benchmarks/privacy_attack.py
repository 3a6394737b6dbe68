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
import torch
from scipy import stats

from fedrec_flwr.fedgnn.user import build_upload, init_user_state, local_gradients
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


def _user_steps(cfg, users: int):
    """For each of the first `users` users with >= 3 ratings, one local step on an untrained seeded model.

    Yields (model, data, state, rows the server sent, model gradients, real rows, rng, is_real),
    where is_real marks the anonymity-set entries the user rated; rng continues to the upload.
    """
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    torch.manual_seed(cfg.seed)  # model initialisation and dropout: the same numbers on every run
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
    for u in range(min(users, meta.num_users)):
        data = parts.user(u)
        if data.train_items.size < 3:
            continue
        state = init_user_state(cfg, meta, data)
        rng = np.random.default_rng(u)
        sent = (rng.standard_normal((state.anonymity_ids.size, cfg.model.dim)) * 0.1).astype(np.float32)
        grads, real_rows, _, _ = local_gradients(cfg, model, state, data, sent, rng)
        yield model, data, state, sent, grads, real_rows, rng, np.isin(state.anonymity_ids, data.train_items)


def _auc(scores: np.ndarray, is_real: np.ndarray) -> float:
    return float(stats.mannwhitneyu(scores[is_real], scores[~is_real]).statistic / (is_real.sum() * (~is_real).sum()))


def within_upload_auc(cfg, users: int, mode: str) -> np.ndarray:
    """Mean over users of the AUC of 'real rows score higher', per feature, folded after averaging.

    mode: "protected" (as configured), or "zeros" (pseudo rows left at zero, no LDP).
    """
    aucs = []
    for _, data, state, _, grads, real_rows, rng, is_real in _user_steps(cfg, users):
        if mode == "zeros":
            up = np.zeros((state.anonymity_ids.size, cfg.model.dim), np.float32)
            up[is_real] = real_rows
        else:
            up = build_upload(cfg, state, data, grads, real_rows, rng)[-1]
        feats = row_features(up)
        aucs.append([_auc(feats[:, j], is_real) for j in range(feats.shape[1])])
    mean = np.mean(aucs, axis=0)
    return np.maximum(mean, 1 - mean)


def model_gradient_auc(cfg, users: int) -> dict[str, float]:
    """Can the model part of an upload point at the real items? AUC of "real items score higher",
    averaged over users, not folded (0.5 = chance; the direction is known in advance).

    Two attacks by a server that knows every row it sent and the public item features:
    "sent rows vs weight gradients": a d x d weight's gradient sums terms (upstream error) x (input
    row) over the real items' edges, so its top singular vectors lean towards the real items' sent
    rows; item j scores its sent row's largest |projection| on them (the best d x d weight reported).
    "feature map" (models with public item features): the map's gradient is the sum over real j
    of f_j (x) g_j, so item j scores <map gradient, f_j (x) its uploaded row g_j>.
    """
    per_weight: dict[int, list[float]] = {}
    feature_map: list[float] = []
    for model, data, state, sent, grads, real_rows, rng, is_real in _user_steps(cfg, users):
        upload = build_upload(cfg, state, data, grads, real_rows, rng)
        for i, p in enumerate(model.parameters()):
            if p.dim() < 2 or p.shape[-1] != cfg.model.dim or p.shape[-2] != cfg.model.dim:
                continue
            left, _, right = np.linalg.svd(upload[i].reshape(-1, cfg.model.dim, cfg.model.dim)[0])
            per_weight.setdefault(i, []).append(_auc(np.maximum(np.abs(sent @ left[:, 0]), np.abs(sent @ right[0])), is_real))
        if data.item_features is not None:
            g_map = upload[[n for n, _ in model.named_parameters()].index("item_feature_map")]
            feature_map.append(_auc(np.einsum("jk,kl,jl->j", data.item_features[state.anonymity_ids], g_map, upload[-1]), is_real))
    out = {"sent rows vs weight gradients": max(float(np.mean(v)) for v in per_weight.values())}
    if feature_map:
        out["feature map"] = float(np.mean(feature_map))
    return out


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
    model_attacks = {}
    for name, extra in (("pseudo rows + LDP (default)", []), ("pseudo rows, no LDP", ["privacy.ldp=false"])):
        for model_name, model_set in (("paper model (GAT)", []), ("tuned model (GGNN + biases) with public item features",
                                      ["model.gnn=ggnn", "model.biases=true", "data.item_features=true"])):
            auc = model_gradient_auc(load_config("fedgnn", "synthetic", [*base, *extra, *model_set]), args.users)
            model_attacks[f"{name}, {model_name}"] = auc
            print(f"model gradients, {name}, {model_name}: " + "  ".join(f"{k}={v:.3f}" for k, v in auc.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dim": args.dim, "users": args.users, "auc": out,
                                          "model_gradient_auc": model_attacks}, indent=1))


if __name__ == "__main__":
    main()
