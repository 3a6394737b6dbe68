"""Cost of Paillier secure aggregation in one FPPDM round, against plaintext, on real domain sizes.

    python -m benchmarks.paillier_cost --dataset douban-book-music --data-dir ../shared/data [--bits 2048] [--dim 128]

For every domain: pack + encrypt its users' (mu, sigma); the server multiplies ciphertexts per
user; every domain decrypts its users' sums. Random distributions of the right shapes stand in
for trained ones (cost does not depend on the values). Reports seconds per phase and bytes up and
down per domain, next to the plaintext barycenter. Writes benchmarks/results/paillier_cost.json.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.common import add_data_dir
from fedrec_flwr.config import load_config
from fedrec_flwr.data import load_from_config
from fedrec_flwr.fppdm.barycenter import user_barycenters
from fedrec_flwr.fppdm.secure_barycenter import (
    decrypt_barycenters,
    encrypt_users,
    per_user_ciphertexts,
    sum_encrypted,
)
from fedrec_flwr.privacy.paillier_pack import (
    DomainKeys,
    FixedPointPacker,
    ciphertexts_to_array,
)


def main() -> None:
    """Time one encrypted aggregation round and one plaintext round."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="douban-book-music")
    add_data_dir(ap)
    ap.add_argument("--bits", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/paillier_cost.json")
    args = ap.parse_args()
    ds = load_from_config(load_config("fppdm", args.dataset, [f"data.data_dir={args.data_dir}"]).data)
    rng = np.random.default_rng(0)
    dists = []
    for d in ds.domains:
        ids = np.unique(d.train_users)
        dists.append((ids, rng.normal(0, 1, (ids.size, args.dim)).astype(np.float32),
                      rng.uniform(0.5, 2, (ids.size, args.dim)).astype(np.float32)))
    t = time.perf_counter()
    user_barycenters(dists, ds.num_users, args.dim)
    plain_s = time.perf_counter() - t
    plain_up = [ids.nbytes + mu.nbytes + s.nbytes for ids, mu, s in dists]

    keys = DomainKeys.generate(args.bits)
    packer = FixedPointPacker(key_bits=args.bits)
    per_user = per_user_ciphertexts(packer, args.dim)
    t = time.perf_counter()
    enc = [(ids, encrypt_users(keys, packer, mu, s)) for ids, mu, s in dists]
    encrypt_s = time.perf_counter() - t
    t = time.perf_counter()
    sums, counts = sum_encrypted(enc, keys.public.n, per_user)
    server_s = time.perf_counter() - t
    t = time.perf_counter()
    down = []
    for ids, _ in enc:
        arr = ciphertexts_to_array([c for u in ids.tolist() for c in sums[u]], args.bits)
        down.append(arr.nbytes + ids.nbytes * 2)
        decrypt_barycenters(keys, packer, arr, np.array([counts[u] for u in ids.tolist()]), args.dim)
    decrypt_s = time.perf_counter() - t
    doc = {
        "date": date.today().isoformat(), "dataset": ds.name, "key_bits": args.bits, "dim": args.dim,
        "domains": [{"name": d.name, "users": int(ids.size)} for d, (ids, _, _) in zip(ds.domains, dists)],
        "values_per_ciphertext": packer.slots, "ciphertexts_per_user": per_user,
        "plaintext": {"server_s": plain_s, "bytes_up_per_domain": plain_up, "bytes_down_per_domain": plain_up},
        "paillier": {"encrypt_s_all_domains": encrypt_s, "server_s": server_s, "decrypt_s_all_domains": decrypt_s,
                     "bytes_up_per_domain": [a.nbytes + ids.nbytes for ids, a in enc], "bytes_down_per_domain": down},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
