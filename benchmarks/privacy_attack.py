"""Can the server tell a user's real item rows from its pseudo rows? Within-upload AUC per feature.

    python -m benchmarks.privacy_attack [--dim 256] [--users 60] [--sampler uniform|popularity]

For each user of a small synthetic dataset the client builds one real upload; the attacker
ranks that upload's rows by each feature and we report the mean AUC over users (0.5 is
chance), for: the full protection (pseudo rows + LDP), pseudo rows without LDP, and a
strawman whose pseudo rows are zeros (the attack's power); then the model-gradient attacks. The
attacks are `fedrec_flwr.audit.attacks`; this is their command line. Writes
benchmarks/results/privacy_attack.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedrec_flwr.audit.attacks import FEATURES, model_gradient_auc, within_upload_auc
from fedrec_flwr.config import load_config


def main() -> None:
    """Measure the three settings and write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--users", type=int, default=60)
    ap.add_argument("--sampler", default="uniform", choices=("uniform", "popularity"), help="privacy.pseudo_sampler")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out_path = args.out or ("benchmarks/results/privacy_attack.json" if args.sampler == "uniform"
                            else f"benchmarks/results/privacy_attack_{args.sampler}.json")
    base = [f"model.dim={args.dim}", "data.synthetic.num_users=60", "data.synthetic.num_items=200",
            "data.synthetic.mean_degree=15", "privacy.pseudo_items=100", "data.cache_dir=.cache/fedrec",
            f"privacy.pseudo_sampler={args.sampler}"]
    settings = {
        "pseudo rows + LDP (default)": (load_config("fedgnn_paper", "synthetic", base), "protected"),
        "pseudo rows, no LDP": (load_config("fedgnn_paper", "synthetic", [*base, "privacy.ldp=false"]), "protected"),
        "zeros for pseudo rows, no LDP": (load_config("fedgnn_paper", "synthetic", [*base, "privacy.ldp=false"]),
                                          "zeros"),
    }
    out = {}
    for name, (cfg, mode) in settings.items():
        auc = within_upload_auc(cfg, args.users, mode)
        out[name] = dict(zip(FEATURES, map(float, auc)))
        print(f"{name:32s} max AUC {auc.max():.3f}  " + "  ".join(f"{f}={a:.3f}" for f, a in zip(FEATURES, auc)))
    model_attacks = {}
    for name, extra in (("pseudo rows + LDP (default)", []), ("pseudo rows, no LDP", ["privacy.ldp=false"])):
        for model_name, model_set in (("paper model (GAT)", []), ("tuned model (GGNN + biases) with "
                                                                  "public item features",
                                      ["model.gnn=ggnn", "model.biases=true", "data.item_features=true"])):
            auc = model_gradient_auc(load_config("fedgnn_paper", "synthetic", [*base, *extra, *model_set]), args.users)
            model_attacks[f"{name}, {model_name}"] = auc
            print(f"model gradients, {name}, {model_name}: " + "  ".join(f"{k}={v:.3f}" for k, v in auc.items()))
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps({"dim": args.dim, "users": args.users, "sampler": args.sampler, "auc": out,
                                          "model_gradient_auc": model_attacks}, indent=1))


if __name__ == "__main__":
    main()
