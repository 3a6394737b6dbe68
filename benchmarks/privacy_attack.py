"""Can the server tell a user's real item rows from its pseudo rows? Within-upload AUC per feature.

    python -m benchmarks.privacy_attack [--dim 256] [--users 60] [--sampler uniform|popularity]
        [--map-std 1.0] [--repeats 3]
    python -m benchmarks.privacy_attack --crafted [--dim 64 --users 30 --repeats 2]   # a hostile server's downloads

For each user of a small synthetic dataset the client builds one real upload; the attacker
ranks that upload's rows by each feature and we report the mean AUC over users (0.5 is
chance), for: the full protection (pseudo rows + LDP), pseudo rows without LDP, and a
strawman whose pseudo rows are zeros (the attack's power), on the paper's model; the first two
again on `fedgnn_tuned`'s (GGNN with biases, summed loss: the item-bias map's features apply); then the
model-gradient attacks, on those models and on the presets `fedgnn_tuned` and `quickstart` as they ship (and,
for the attacks' power, the presets' uploads without the pseudo items' terms in the item maps' gradients).
Every run's devices draw fresh secrets (their noise, pseudo items and pseudo
rows; the model and the rows sent stay the same), so the AUCs move between runs: each is
measured --repeats times and recorded as mean, standard deviation and largest. The
attacks are `fedrec_flwr.audit.attacks`; this is their command line. Writes
benchmarks/results/privacy_attack.json.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import numpy as np

from fedrec_flwr.audit.attacks import AUDIT_MAP_STD, AUDIT_ROW_STD, FEATURES, model_gradient_auc, within_upload_auc
from fedrec_flwr.config import load_config

# fedgnn_tuned's model and loss: the summed loss makes each real row's gradient n times the mean loss's
TUNED = ["model.gnn=ggnn", "model.biases=true", "local.loss=sum", "local.batch_size=1000"]
# the LDP presets whose model part is audited as they ship (their GNN, loss, rates), at the audit's data and sizes
PRESETS = ("fedgnn_tuned", "quickstart")
# what a hostile server can craft that each device accepts (its download bound, its policy's epsilon per coordinate):
# (config overrides, std of the item rows it sends). Each scales the weight gradients up to the clip, where their
# sign pattern survives the noise
CRAFTED = {
    "as trained (no crafting)": ([], AUDIT_ROW_STD),
    "item rows sent at 1.0 per entry": ([], 1.0),
    "clip 0.001 with noise 0.002 (the same epsilon per coordinate)": (
        ["privacy.clip_delta=0.001", "privacy.noise_lambda=0.002"], AUDIT_ROW_STD),
    "delta uploads of 100 steps at rate 1e-9": (["local.upload=delta", "local.steps=100", "local.lr=1e-9"],
                                                AUDIT_ROW_STD),
}


def main() -> None:
    """Measure the three settings and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--users", type=int, default=60)
    ap.add_argument("--sampler", default="uniform", choices=("uniform", "popularity"), help="privacy.pseudo_sampler")
    ap.add_argument("--map-std", type=float, default=AUDIT_MAP_STD,
                    help="the GGNN model's item-bias map per entry: a trained one's (default) or one a server crafts")
    ap.add_argument("--repeats", type=int, default=3, help="runs, each with fresh device secrets (default: 3)")
    ap.add_argument("--crafted", action="store_true",
                    help="only the model-gradient attack on the LDP presets under what a hostile server crafts "
                         "(CRAFTED), written to benchmarks/results/privacy_attack_crafted.json")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out_path = args.out or ("benchmarks/results/privacy_attack.json" if args.sampler == "uniform"
                            else f"benchmarks/results/privacy_attack_{args.sampler}.json")
    if args.map_std != AUDIT_MAP_STD and not args.out:
        out_path = out_path.replace(".json", f"_map_{args.map_std:g}.json")
    base = [f"model.dim={args.dim}", "data.synthetic.num_users=60", "data.synthetic.num_items=200",
            "data.synthetic.mean_degree=15", "privacy.pseudo_items=100", "data.cache_dir=.cache/fedrec",
            f"privacy.pseudo_sampler={args.sampler}"]
    if args.crafted:
        crafted(base, args.users, args.repeats, args.out or "benchmarks/results/privacy_attack_crafted.json")
        return
    settings = {
        "pseudo rows + LDP (default)": (load_config("fedgnn_paper", "synthetic", base), "protected"),
        "pseudo rows, no LDP": (load_config("fedgnn_paper", "synthetic", [*base, "privacy.ldp=false"]), "protected"),
        "zeros for pseudo rows, no LDP": (load_config("fedgnn_paper", "synthetic", [*base, "privacy.ldp=false"]),
                                          "zeros"),
        # fedgnn_tuned's model: the features include each row's projection on the item-bias map the server sent
        "tuned model (GGNN + biases), pseudo rows + LDP": (load_config("fedgnn_paper", "synthetic", [*base, *TUNED]),
                                                          "protected"),
        "tuned model (GGNN + biases), pseudo rows, no LDP": (
            load_config("fedgnn_paper", "synthetic", [*base, *TUNED, "privacy.ldp=false"]), "protected"),
    }
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    runs: list[dict] = []
    for r in range(args.repeats):  # every audited device draws a fresh secret: its noise and pseudo rows differ
        out = {}
        for name, (cfg, mode) in settings.items():
            auc = within_upload_auc(cfg, args.users, mode, args.map_std)
            out[name] = dict(zip(FEATURES, map(float, auc)))
            print(f"[run {r}] {name:32s} max AUC {auc.max():.3f}  "
                  + "  ".join(f"{f}={a:.3f}" for f, a in zip(FEATURES, auc)), flush=True)
        model_attacks = {}
        for name, extra in (("pseudo rows + LDP (default)", []), ("pseudo rows, no LDP", ["privacy.ldp=false"])):
            for model_name, model_set in (("paper model (GAT)", []), ("tuned model (GGNN + biases) with "
                                                                      "public item features",
                                          [*TUNED, "data.item_features=true"])):
                auc = model_gradient_auc(load_config("fedgnn_paper", "synthetic", [*base, *extra, *model_set]),
                                         args.users, args.map_std)
                model_attacks[f"{name}, {model_name}"] = auc
                print(f"[run {r}] model gradients, {name}, {model_name}: "
                      + "  ".join(f"{k}={v:.3f}" for k, v in auc.items()), flush=True)
        for preset in PRESETS:  # the LDP presets themselves, at the audit's sizes
            auc = model_gradient_auc(load_config(preset, "synthetic", base), args.users, args.map_std)
            model_attacks[f"pseudo rows + LDP (default), preset {preset}"] = auc
            print(f"[run {r}] model gradients, preset {preset}: "
                  + "  ".join(f"{k}={v:.3f}" for k, v in auc.items()), flush=True)
            # the attacks' power: the same uploads without the pseudo items' terms in the item maps' gradients
            bare = model_gradient_auc(load_config(preset, "synthetic", base), args.users, args.map_std, map_terms=False)
            model_attacks[f"pseudo rows + LDP, no pseudo map terms, preset {preset}"] = bare
            print(f"[run {r}] model gradients, preset {preset}, no pseudo map terms: "
                  + "  ".join(f"{k}={v:.3f}" for k, v in bare.items()), flush=True)
        runs.append({"auc": out, "model_gradient_auc": model_attacks})
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps({
        "dim": args.dim, "users": args.users, "sampler": args.sampler, "item_bias_map_std": args.map_std,
        "repeats": args.repeats, "auc": summary([run["auc"] for run in runs]),
        "model_gradient_auc": summary([run["model_gradient_auc"] for run in runs]), "runs": runs,
        "date": date.today().isoformat()}, indent=1))


def crafted(base: list[str], users: int, repeats: int, out_path: str) -> None:
    """The model-gradient attack on the paper's preset and each LDP preset under each of CRAFTED, `repeats` runs
    with fresh device secrets: what a server that crafts its downloads or the run's settings (within every device
    check) reads off the weight gradients. Writes the mean, sample std and largest AUC per (preset, crafting)."""
    runs = []
    for r in range(repeats):
        out = {}
        for preset in ("fedgnn_paper", *PRESETS):  # the paper's own (GAT, mean loss) too
            for name, (extra, row_std) in CRAFTED.items():
                auc = model_gradient_auc(load_config(preset, "synthetic", [*base, *extra]), users, AUDIT_MAP_STD,
                                         row_std)
                out[f"{preset}, {name}"] = auc
                print(f"[run {r}] {preset}, {name}: " + "  ".join(f"{k}={v:.3f}" for k, v in auc.items()), flush=True)
        runs.append(out)
    Path(out_path).write_text(json.dumps({"base": base, "users": users, "repeats": repeats,
                                          "crafted": {k: {"set": v[0], "row_std": v[1]} for k, v in CRAFTED.items()},
                                          "model_gradient_auc": summary(runs), "runs": runs,
                                          "date": date.today().isoformat()}, indent=1))


def summary(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per setting and attack: the mean, sample standard deviation (0 for one run) and largest AUC over the runs."""
    return {setting: {attack: {"mean": float(np.mean([run[setting][attack] for run in runs])),
                               "std": float(np.std([run[setting][attack] for run in runs], ddof=1))
                               if len(runs) > 1 else 0.0,
                               "max": float(np.max([run[setting][attack] for run in runs]))}
                      for attack in runs[0][setting]}
            for setting in runs[0]}


if __name__ == "__main__":
    main()
