"""Paillier secure aggregation with fixed-point packing (FPPDM's optional protection).

The domains share a key pair the recommendation server does not have. Each value v is
encoded as round((v + offset) * 2^frac) in a slot of `slot_bits` bits; `slots` such values are
packed into one plaintext (base 2^slot_bits), so one ciphertext carries many values. The
server multiplies ciphertexts (adds plaintexts) of the same user across domains; slots have
headroom for the sum of up to `max_terms` values, so no carry crosses a slot. The domains
decrypt, unpack and divide by the number of domains that contributed.

Limit: with K = 2 domains the sum reveals the other domain's values to each domain (it
subtracts its own). Secure aggregation hides individual values only from the server, and
from domains when K >= 3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from phe import paillier


@dataclass(frozen=True)
class FixedPointPacker:
    """Fixed-point encoding of bounded floats, several per Paillier plaintext."""

    key_bits: int = 2048
    frac_bits: int = 16
    int_bits: int = 8  # |v| < 2^(int_bits - 1) after clipping to `bound`
    max_terms: int = 16  # ciphertexts that may be summed without overflow

    @property
    def bound(self) -> float:
        """Values must lie in (-bound, bound)."""
        return float(2 ** (self.int_bits - 1))

    @property
    def slot_bits(self) -> int:
        """Bits per slot: value bits plus headroom for the sum of max_terms values."""
        return self.frac_bits + self.int_bits + int(np.ceil(np.log2(self.max_terms)))

    @property
    def slots(self) -> int:
        """Values per ciphertext (one slot of margin below the modulus)."""
        return self.key_bits // self.slot_bits - 1

    def pack(self, values: np.ndarray) -> list[int]:
        """Integers (plaintexts) carrying `values` in order; ValueError if any value is out of range."""
        v = np.asarray(values, np.float64).ravel()
        if v.size and np.abs(v).max() >= self.bound:
            raise ValueError(f"value {np.abs(v).max():.3g} outside the fixed-point range (-{self.bound}, {self.bound})")
        enc = np.round((v + self.bound) * (1 << self.frac_bits)).astype(object)
        out = []
        for start in range(0, enc.size, self.slots):
            acc = 0
            for x in enc[start : start + self.slots][::-1]:
                acc = (acc << self.slot_bits) | int(x)
            out.append(acc)
        return out

    def unpack(self, plaintexts: list[int], count: int, terms: int) -> np.ndarray:
        """The element-wise sum of `terms` packed vectors, decoded back to `count` floats."""
        mask = (1 << self.slot_bits) - 1
        vals = []
        for p in plaintexts:
            for _ in range(self.slots):
                vals.append(p & mask)
                p >>= self.slot_bits
        raw = np.asarray(vals[:count], dtype=np.float64)
        return raw / (1 << self.frac_bits) - terms * self.bound


def ciphertexts_to_array(cts: list[int], key_bits: int) -> np.ndarray:
    """Ciphertexts (< n^2) as a uint8 array [len, 2*key_bits/8], big-endian: a Flower-friendly NDArray."""
    width = 2 * key_bits // 8
    return np.frombuffer(b"".join(c.to_bytes(width, "big") for c in cts), np.uint8).reshape(len(cts), width)


def array_to_ciphertexts(arr: np.ndarray) -> list[int]:
    """Inverse of ciphertexts_to_array."""
    return [int.from_bytes(row.tobytes(), "big") for row in np.asarray(arr, np.uint8)]


def add_ciphertexts(public_n: int, columns: list[list[int]]) -> list[int]:
    """Homomorphic sum: element-wise product modulo n^2 of several ciphertext lists."""
    nsq = public_n * public_n
    out = list(columns[0])
    for col in columns[1:]:
        out = [(a * b) % nsq for a, b in zip(out, col)]
    return out


@dataclass
class DomainKeys:
    """The domains' shared Paillier key pair (never given to the recommendation server)."""

    public: paillier.PaillierPublicKey
    private: paillier.PaillierPrivateKey

    @staticmethod
    def generate(key_bits: int = 2048) -> "DomainKeys":
        """A fresh key pair."""
        pub, priv = paillier.generate_paillier_keypair(n_length=key_bits)
        return DomainKeys(pub, priv)

    def save(self, path: Path) -> None:
        """Write the key pair to a JSON file readable only by its owner."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"n": str(self.public.n), "p": str(self.private.p), "q": str(self.private.q)}))
        path.chmod(0o600)

    @staticmethod
    def load(path: Path) -> "DomainKeys":
        """Read a key pair written by `save`; ValueError naming the file if it is not one."""
        try:
            raw = json.loads(Path(path).read_text())
            pub = paillier.PaillierPublicKey(int(raw["n"]))
            return DomainKeys(pub, paillier.PaillierPrivateKey(pub, int(raw["p"]), int(raw["q"])))
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"{path}: not a Paillier key pair file (expected JSON with n, p, q): {exc}") from exc

    def encrypt(self, plaintexts: list[int]) -> list[int]:
        """Randomised encryption of each plaintext."""
        return [self.public.raw_encrypt(p) for p in plaintexts]

    def decrypt(self, ciphertexts: list[int]) -> list[int]:
        """Decryption of each ciphertext."""
        return [self.private.raw_decrypt(c) for c in ciphertexts]


def main() -> None:
    """CLI: python -m fedrec_flwr.privacy.paillier_pack --out keys/domains.json [--bits 2048]"""
    import argparse

    ap = argparse.ArgumentParser(description="Generate the FPPDM domains' shared Paillier key pair")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bits", type=int, default=2048)
    args = ap.parse_args()
    DomainKeys.generate(args.bits).save(Path(args.out))
    print(f"wrote {args.out} (give it to every domain, never to the recommendation server)")


if __name__ == "__main__":
    main()
