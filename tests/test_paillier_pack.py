"""Paillier packing: sums of packed encrypted vectors decrypt to the plaintext sums; ciphertexts are randomised."""

import numpy as np
import pytest

from fedrec_flwr.privacy.paillier_pack import (
    DomainKeys,
    FixedPointPacker,
    add_ciphertexts,
    array_to_ciphertexts,
    ciphertexts_to_array,
)


@pytest.fixture(scope="module")
def keys():
    return DomainKeys.generate(1024)


def test_pack_roundtrip_and_range_check():
    packer = FixedPointPacker(key_bits=1024)
    v = np.random.default_rng(0).uniform(-100, 100, 200)
    assert packer.slots > 20
    assert np.allclose(packer.unpack(packer.pack(v), v.size, 1), v, atol=2 ** -16)
    with pytest.raises(ValueError, match="outside the fixed-point range"):
        packer.pack(np.array([1e6]))


def test_encrypted_sum_of_three_domains_decrypts_to_the_mean(keys, tmp_path):
    packer = FixedPointPacker(key_bits=1024)
    rng = np.random.default_rng(1)
    vectors = [rng.normal(0, 3, 150) for _ in range(3)]
    cts = [keys.encrypt(packer.pack(v)) for v in vectors]
    wire = [ciphertexts_to_array(c, 1024) for c in cts]  # what the server receives
    summed = add_ciphertexts(keys.public.n, [array_to_ciphertexts(w) for w in wire])
    mean = packer.unpack(keys.decrypt(summed), 150, 3) / 3
    assert np.allclose(mean, np.mean(vectors, 0), atol=1e-4)
    keys.save(tmp_path / "k.json")
    assert DomainKeys.load(tmp_path / "k.json").private.p == keys.private.p
    with pytest.raises(ValueError, match="not a Paillier key pair file"):
        (tmp_path / "bad.json").write_text("{}")
        DomainKeys.load(tmp_path / "bad.json")


def test_equal_plaintexts_give_different_ciphertexts(keys):
    a, b = keys.encrypt([42, 42])
    assert a != b and keys.decrypt([a, b]) == [42, 42]
