"""FPPDM's barycenter under Paillier: domains encrypt packed (mu, sigma), the server only multiplies.

Domain upload: [user ids, ciphertexts uint8 [users * per_user, width], public n (uint8 bytes)].
Server reply:  [user ids, summed ciphertexts for those users, number of domains per user].
The server learns which users each domain holds (needed to know whom to add), never a value.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedrec_flwr.config import SecureAggregationConfig
from fedrec_flwr.privacy.paillier_pack import (
    DomainKeys,
    FixedPointPacker,
    add_ciphertexts,
    array_to_ciphertexts,
    ciphertexts_to_array,
)


def domain_crypto(secure: SecureAggregationConfig) -> tuple[DomainKeys, FixedPointPacker] | None:
    """A domain's shared Paillier key pair and fixed-point packer from `fppdm.secure`; None when it is off."""
    if not secure.enabled:
        return None
    if not secure.key_file:
        raise ValueError("fppdm.secure.enabled needs fppdm.secure.key_file: create one with "
                         "`python -m fedrec_flwr.privacy.paillier_pack --out FILE` and give it to every domain")
    keys = DomainKeys.load(Path(secure.key_file))
    bits = keys.public.n.bit_length()
    if abs(bits - secure.key_bits) > 1:  # phe's n of n_length bits may come out one bit short
        raise ValueError(f"fppdm.secure.key_file {secure.key_file} holds a {bits}-bit Paillier key; "
                         f"fppdm.secure.key_bits = {secure.key_bits} (the fixed-point slots are sized by it)")
    return keys, FixedPointPacker(key_bits=secure.key_bits)


def per_user_ciphertexts(packer: FixedPointPacker, dim: int) -> int:
    """Ciphertexts needed for one user's 2*dim values."""
    return -(-2 * dim // packer.slots)


def encrypt_users(keys: DomainKeys, packer: FixedPointPacker, mu: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Each user's [mu | sigma] packed and encrypted; rows grouped per user."""
    cts: list[int] = []
    for m, s in zip(mu, sigma):
        cts.extend(keys.encrypt(packer.pack(np.concatenate([m, s]))))
    return ciphertexts_to_array(cts, packer.key_bits)


def public_n_array(keys: DomainKeys) -> np.ndarray:
    """The public modulus as bytes, so the server can multiply ciphertexts."""
    n = keys.public.n
    return np.frombuffer(n.to_bytes((n.bit_length() + 7) // 8, "big"), np.uint8).copy()


def sum_encrypted(
    uploads: list[tuple[np.ndarray, np.ndarray]], public_n: int, per_user: int
) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Server side: per user, the product (= encrypted sum) of its ciphertexts over domains, and the count."""
    sums: dict[int, list[int]] = {}
    counts: dict[int, int] = {}
    for ids, arr in uploads:
        cts = array_to_ciphertexts(arr)
        for row, user in enumerate(ids.tolist()):
            mine = cts[row * per_user : (row + 1) * per_user]
            sums[user] = mine if user not in sums else add_ciphertexts(public_n, [sums[user], mine])
            counts[user] = counts.get(user, 0) + 1
    return sums, counts


def decrypt_barycenters(
    keys: DomainKeys, packer: FixedPointPacker, arr: np.ndarray, counts: np.ndarray, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Domain side: decrypt the summed ciphertexts and divide by the domain counts -> (mu, sigma)."""
    per_user = per_user_ciphertexts(packer, dim)
    cts = array_to_ciphertexts(arr)
    mu = np.empty((counts.size, dim), np.float32)
    sigma = np.empty((counts.size, dim), np.float32)
    for row, c in enumerate(counts.tolist()):
        vals = packer.unpack(keys.decrypt(cts[row * per_user : (row + 1) * per_user]), 2 * dim, c) / c
        mu[row], sigma[row] = vals[:dim], vals[dim:]
    return mu, sigma
