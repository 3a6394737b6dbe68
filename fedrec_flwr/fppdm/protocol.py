"""The FPPDM wire format shared by the domain client and the strategy.

A message is a list of arrays in a fixed order; these functions are the one place that order is
written. Every domain SuperNode hosts one domain. n is the number of users the message is about,
D the model's dim, W the byte width of one Paillier ciphertext (2 * key_bits / 8).

Client -> server (fit), plaintext: [user ids int64[n] (global, distinct), mu float32[n, D], sigma
float32[n, D]]: the propagated Gaussians of the domain's users with training positives.
Under Paillier (`fppdm.secure.enabled`): [user ids int64[n], ciphertexts uint8[n * per_user, W] (each
user's mu and sigma packed into fixed-point slots, `privacy.paillier_pack`), public modulus uint8[<=
key_bits / 8 + 1]]. num_examples is 1 (one domain); the metrics carry "train_loss".

Server -> client (fit): nothing before the first applied round; then plaintext [user ids int64[m], mu
float32[m, D], sigma float32[m, D]]: the barycenters of the domain's own users, or under Paillier
[user ids int64[m], summed ciphertexts uint8[m * per_user, W], domain counts int64[m]], which the domain
decrypts and divides by the counts.

Client -> server (evaluate): no arrays; metrics {"n": test users ranked, "domain": its name,
"hr@K" and "ndcg@K" for each K of `fppdm.evaluation.topk`}.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedrec_flwr.messages import UploadRejected

PLAIN_FIELDS = ("user ids", "mu", "sigma")
ENCRYPTED_UPLOAD_FIELDS = ("user ids", "ciphertexts", "public key")
ENCRYPTED_DOWNLOAD_FIELDS = ("user ids", "summed ciphertexts", "domain counts")


class Gaussians(NamedTuple):
    """Per-user diagonal Gaussians on the wire: global ids [n], mu [n, D], sigma [n, D]."""

    ids: np.ndarray
    mu: np.ndarray
    sigma: np.ndarray


class Ciphertexts(NamedTuple):
    """Per-user Paillier ciphertexts on the wire: global ids [n], ciphertext bytes [n * per_user, W], and the
    public modulus (uploads) or the per-user domain counts (downloads)."""

    ids: np.ndarray
    ciphertexts: np.ndarray
    extra: np.ndarray


def frame_gaussians(ids: np.ndarray, mu: np.ndarray, sigma: np.ndarray) -> list[np.ndarray]:
    """[ids, mu, sigma]: a plaintext upload or download."""
    return [np.asarray(ids, np.int64), np.asarray(mu, np.float32), np.asarray(sigma, np.float32)]


def frame_ciphertexts(ids: np.ndarray, ciphertexts: np.ndarray, extra: np.ndarray) -> list[np.ndarray]:
    """[ids, ciphertexts, public modulus | domain counts]: an encrypted upload or download."""
    return [np.asarray(ids, np.int64), ciphertexts, extra]


def _three(arrays: list[np.ndarray], fields: tuple[str, ...]) -> list[np.ndarray]:
    if len(arrays) != len(fields):
        raise UploadRejected(f"expected {len(fields)} arrays ({', '.join(fields)}), got {len(arrays)}")
    return [np.asarray(a) for a in arrays]


def split_gaussians(arrays: list[np.ndarray]) -> Gaussians:
    """The fields of a plaintext message (shapes and values are checked by whoever reads them)."""
    return Gaussians(*_three(arrays, PLAIN_FIELDS))


def split_encrypted_upload(arrays: list[np.ndarray]) -> Ciphertexts:
    """The fields of an encrypted upload: ids, ciphertexts, public modulus."""
    return Ciphertexts(*_three(arrays, ENCRYPTED_UPLOAD_FIELDS))


def split_encrypted_download(arrays: list[np.ndarray]) -> Ciphertexts:
    """The fields of an encrypted download: ids, summed ciphertexts, domain counts."""
    return Ciphertexts(*_three(arrays, ENCRYPTED_DOWNLOAD_FIELDS))
