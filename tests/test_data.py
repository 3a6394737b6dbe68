"""Data layer: synthetic determinism, each loader on fixtures of its format, malformed-input errors, partitions."""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.data import DataError, UserPartitions, load_dataset, prepare_partitions
from fedrec_flwr.data.loaders import (
    load_disencdr_pair,
    load_gadtcdr,
    load_ratings_dat,
    load_split_files,
    load_srgcnn_mat,
)
from fedrec_flwr.data.partition import write_partitions
from fedrec_flwr.data.synthetic import make_synthetic, make_synthetic_multidomain
from fedrec_flwr.data.types import RatingScale

ONE_FIVE = RatingScale(1, 5, 1)
HALF = RatingScale(0.5, 5, 0.5)


def write_mat_v73(path, arrays: dict[str, np.ndarray]) -> None:
    """A MATLAB v7.3 file: HDF5 with a 512-byte user block, arrays stored column-major (transposed)."""
    import h5py

    with h5py.File(path, "w", userblock_size=512) as fh:
        for k, v in arrays.items():
            fh.create_dataset(k, data=np.asarray(v, np.float64).T)
    with open(path, "r+b") as fh:
        fh.write(b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created on: test HDF5 schema 1.00 .")


def test_synthetic_is_deterministic_and_seed_sensitive():
    a, b, c = make_synthetic(seed=3), make_synthetic(seed=3), make_synthetic(seed=4)
    assert np.array_equal(a.train.items, b.train.items) and np.array_equal(a.test.values, b.test.values)
    assert not np.array_equal(a.train.values[:200], c.train.values[:200])


def test_synthetic_shape_scale_and_power_law():
    ds = make_synthetic(seed=0, num_users=800, num_items=400)
    assert set(np.unique(ds.train.values)) <= {1, 2, 3, 4, 5}
    deg = np.bincount(ds.train.users, minlength=ds.num_users)
    assert deg.min() >= 1 and deg.max() > 4 * np.median(deg)  # heavy tail
    # every test user has a training rating
    assert np.all(deg[np.unique(ds.test.users)] > 0)


def test_split_files_loader(tmp_path):
    (tmp_path / "a.base").write_text("1\t10\t5\t0\n2\t10\t3\t0\n2\t11\t4\t0\n")
    (tmp_path / "a.test").write_text("1\t11\t2\t0\n")
    ds = load_split_files("t", tmp_path / "a.base", tmp_path / "a.test", "\t", ONE_FIVE)
    assert (ds.num_users, ds.num_items, len(ds.train), len(ds.test)) == (2, 2, 3, 1)
    assert ds.test.values.tolist() == [2.0]


def test_ratings_dat_loader_gcmc_split(tmp_path):
    lines = [f"{u}::{i}::{(u * i) % 10 / 2 + 0.5}::97830" for u in range(1, 21) for i in (1, 5, 9, 30)]
    (tmp_path / "ratings.dat").write_text("\n".join(lines) + "\n")
    ds = load_ratings_dat("ml-10m", tmp_path / "ratings.dat", HALF)
    assert len(ds.train) + len(ds.test) == 80 and len(ds.test) == 8  # ceil(10%)
    again = load_ratings_dat("ml-10m", tmp_path / "ratings.dat", HALF)
    assert np.array_equal(ds.test.items, again.test.items)  # seed 1234 split is fixed
    assert ds.num_items == 4  # raw ids 1,5,9,30 compacted


def test_mat_v73_loader(tmp_path):
    m = np.array([[5, 0, 3], [0, 4, 1]], float)
    o_tr = np.array([[1, 0, 0], [0, 1, 0]], float)
    o_te = np.array([[0, 0, 1], [0, 0, 1]], float)
    write_mat_v73(tmp_path / "x.mat", {"M": m, "Otraining": o_tr, "Otest": o_te})
    ds = load_srgcnn_mat("douban", tmp_path / "x.mat", ONE_FIVE)
    assert (ds.num_users, ds.num_items) == (2, 3)
    assert sorted(ds.train.values.tolist()) == [4.0, 5.0] and sorted(ds.test.values.tolist()) == [1.0, 3.0]


def test_mat_wrong_key_is_named(tmp_path):
    write_mat_v73(tmp_path / "x.mat", {"M": np.eye(2), "Otrain": np.eye(2), "Otest": np.zeros((2, 2))})
    with pytest.raises(DataError, match=r"x\.mat: missing key 'Otraining'"):
        load_srgcnn_mat("douban", tmp_path / "x.mat", ONE_FIVE)


def test_mat_not_hdf5(tmp_path):
    (tmp_path / "x.mat").write_bytes(b"MATLAB 5.0 MAT-file" + b"\0" * 200)
    with pytest.raises(DataError, match="not a MATLAB v7.3"):
        load_srgcnn_mat("douban", tmp_path / "x.mat", ONE_FIVE)


@pytest.mark.parametrize(
    "content, pattern",
    [
        ("1\t2\t5\t0\n3\t4\n", r"a\.base:2: expected at least 3 fields"),  # truncated line
        ("1\t2\t5\t0\nx\t4\t3\t0\n", r"a\.base:2: expected integer user and item ids"),  # malformed
        ("1\t2\t7\t0\n", r"rating 7.0 .* not on the scale"),  # out of scale
        ("-1\t2\t5\t0\n", r"user id -1 out of range"),  # ids out of range
        ("\n\n", r"empty file"),  # empty dataset
    ],
)
def test_malformed_inputs_name_file_line_and_expectation(tmp_path, content, pattern):
    (tmp_path / "a.base").write_text(content)
    (tmp_path / "a.test").write_text("1\t2\t5\t0\n")
    with pytest.raises(DataError, match=pattern):
        load_split_files("t", tmp_path / "a.base", tmp_path / "a.test", "\t", ONE_FIVE)


def test_missing_file_message_says_where_to_put_it(tmp_path):
    with pytest.raises(DataError) as err:
        load_dataset("ml-100k", tmp_path / "nodata", tmp_path / "cache")
    msg = str(err.value)
    assert (f"put ml-100k/u1.base at {tmp_path / 'nodata' / 'ml-100k' / 'u1.base'}" in msg
            and "data.download=true" in msg)


def test_unknown_dataset_lists_registry():
    with pytest.raises(DataError, match="unknown dataset 'netflix'.*ml-100k"):
        load_dataset("netflix", "data")


def test_gadtcdr_loader_filters_and_leaves_one_out(tmp_path):
    rng = np.random.default_rng(0)
    for dom in ("douban_book", "douban_music"):
        (tmp_path / dom).mkdir()
        rows = [f"{u}\t{i}\t{rng.integers(3, 6)}" for u in range(1, 30)
                for i in rng.choice(np.arange(1, 25), 12, replace=False)]
        (tmp_path / dom / "ratings.dat").write_text("\n".join(rows) + "\n")
    ds = load_gadtcdr("dbm", tmp_path, ("douban_book", "douban_music"), seed=1)
    for d in ds.domains:
        assert d.test_users.size == np.unique(d.test_users).size  # one test item per user
        train_pairs = set(zip(d.train_users.tolist(), d.train_items.tolist()))
        assert not any((u, i) in train_pairs for u, i in zip(d.test_users.tolist(), d.test_items.tolist()))
    again = load_gadtcdr("dbm", tmp_path, ("douban_book", "douban_music"), seed=1)
    assert np.array_equal(ds.domains[0].test_items, again.domains[0].test_items)


def test_disencdr_pair_loader(tmp_path):
    for folder in ("a_b", "b_a"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.txt").write_text("0\t1\t1\n0\t2\t1\n1\t0\t1\n")
        (tmp_path / folder / "test.txt").write_text("0\t3\t1\n")
    ds = load_disencdr_pair("disencdr:a_b", tmp_path, "a", "b")
    assert [d.name for d in ds.domains] == ["a", "b"] and ds.num_users == 2
    with pytest.raises(DataError, match="missing folder"):
        load_disencdr_pair("disencdr:a_c", tmp_path, "a", "c")


def test_synthetic_multidomain_k3_with_partial_users():
    ds = make_synthetic_multidomain(seed=0, num_domains=3)
    sets = [set(np.unique(d.train_users).tolist()) for d in ds.domains]
    everywhere = sets[0] & sets[1] & sets[2]
    assert len(ds.domains) == 3 and everywhere and any(s - everywhere for s in sets)


def test_partitions_slice_matches_dataset_and_build_is_atomic(tmp_path, tiny_cfg, monkeypatch):
    cfg = tiny_cfg()
    directory = prepare_partitions(cfg.data)
    parts = UserPartitions(directory)
    ds = make_synthetic(seed=cfg.data.seed, num_users=60, num_items=80, mean_degree=12)
    for u in (0, 17, 59):
        mine = parts.user(u)
        sel = ds.train.users == u
        assert np.array_equal(mine.train_items, np.sort(ds.train.items[sel]))
    assert parts.meta.num_users == 60 and parts.meta.scale.high == 5
    # an interrupted build leaves no folder a later run would trust
    import fedrec_flwr.data.partition as partition

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(partition.np, "save", boom)
    target = tmp_path / "p2"
    with pytest.raises(OSError):
        write_partitions(ds, target, "k")
    assert not target.exists() and not list(tmp_path.glob(".p2.part-*"))


def test_real_ml100k_u1_split(shared_data, tmp_path):
    ds = load_dataset("ml-100k", shared_data, tmp_path)
    assert (ds.num_users, len(ds.train), len(ds.test)) == (943, 80000, 20000)
    assert ds.scale == ONE_FIVE


def test_real_douban_mat(shared_data, tmp_path):
    ds = load_dataset("douban", shared_data, tmp_path)
    assert (ds.num_users, ds.num_items, len(ds.train), len(ds.test)) == (3000, 3000, 123202, 13689)
