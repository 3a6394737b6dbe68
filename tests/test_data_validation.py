"""Data trust boundary: bad values in every reader format, a content-keyed partition cache, damaged caches."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from test_data import write_mat_v73

import fedrec_flwr.data.partition as partition
from fedrec_flwr.config import load_config
from fedrec_flwr.data import DataError, UserPartitions, load_dataset, prepare_partitions
from fedrec_flwr.data.readers import MAX_ID

# per format: the files of a small valid dataset, the file the bad line goes into, and how a line is written
GOOD_ROWS = [(1, 1, 5), (1, 2, 4), (2, 1, 3), (2, 3, 4), (3, 2, 5), (3, 3, 1)]
FORMATS = {
    "ml-100k": (("ml-100k/u1.base", "ml-100k/u1.test"), "ml-100k/u1.base", lambda u, i, r: f"{u}\t{i}\t{r}\t881250949"),
    "ml-1m": (("ml-1m/ratings.dat",), "ml-1m/ratings.dat", lambda u, i, r: f"{u}::{i}::{r}::978300760"),
    "douban-book-music": (("douban_gadtcdr/douban_book/ratings.dat", "douban_gadtcdr/douban_music/ratings.dat"),
                          "douban_gadtcdr/douban_music/ratings.dat", lambda u, i, r: f"{u}\t{i}\t{r}"),
    "disencdr:a_b": (tuple(f"disencdr_amazon/{d}/{f}" for d in ("a_b", "b_a") for f in ("train.txt", "test.txt")),
                     "disencdr_amazon/b_a/test.txt", lambda u, i, r: f"{u}\t{i}\t1"),
}
RATED = ("ml-100k", "ml-1m", "douban-book-music")


def _write_dataset(root, name: str, bad_line: bytes):
    """A valid dataset of format `name` under root, with `bad_line` as line 2 of its target file (a test split
    holds other items than its training split: a pair in both is refused)."""
    files, target, line = FORMATS[name]
    for rel in files:
        shift = 3 if rel.endswith(("u1.test", "test.txt")) else 0
        rows = [line(u, i + shift, r).encode() for u, i, r in GOOD_ROWS]
        if rel == target:
            rows.insert(1, bad_line)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\n".join(rows) + b"\n")
    return root / target


CASES = [
    *[(name, (5, 1, "nan"), "rating 'nan' is not a finite number") for name in RATED],
    *[(name, (5, 1, "inf"), "rating 'inf' is not a finite number") for name in RATED],
    *[(name, (5, 1, "-Infinity"), "rating '-Infinity' is not a finite number") for name in RATED],
    *[(name, (-4, 1, 3), "user id -4 out of range") for name in FORMATS],
    *[(name, (5, -2, 3), "item id -2 out of range") for name in FORMATS],
    *[(name, (10**30, 1, 3), f"user id {10**30} out of range (expected") for name in FORMATS],
    *[(name, (5, MAX_ID + 1, 3), f"item id {MAX_ID + 1} out of range") for name in FORMATS],
    ("douban-book-music", (0, 1, 3), "user id 0 out of range (expected 1 <= id"),  # 1-based ids
]


@pytest.mark.parametrize("name, row, reason", CASES, ids=[f"{c[0]}-{c[2][:24]}" for c in CASES])
def test_bad_values_name_the_file_and_line(tmp_path, name, row, reason):
    path = _write_dataset(tmp_path, name, FORMATS[name][2](*row).encode())
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:2: {reason}")):
        load_dataset(name, tmp_path, tmp_path / "cache")


@pytest.mark.parametrize("name", FORMATS)
def test_undecodable_bytes_name_the_file_and_line(tmp_path, name):
    path = _write_dataset(tmp_path, name, b"4\t\xff\xfe\t3")
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:2: not UTF-8 text")):
        load_dataset(name, tmp_path, tmp_path / "cache")


def _mat(tmp_path, m=None, o_train=None, o_test=None):
    m = np.array([[5, 0, 3], [0, 4, 1]], float) if m is None else m
    o_train = np.array([[1, 0, 0], [0, 1, 0]], float) if o_train is None else o_train
    o_test = np.array([[0, 0, 1], [0, 0, 1]], float) if o_test is None else o_test
    path = tmp_path / "douban" / "training_test_dataset.mat"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_mat_v73(path, {"M": m, "Otraining": o_train, "Otest": o_test})
    return path


@pytest.mark.parametrize("bad, reason", [
    (np.nan, "key 'M' has NaN or infinite ratings"),
    (np.inf, "key 'M' has NaN or infinite ratings"),
    (1e300, "key 'M' has NaN or infinite ratings"),  # finite in float64, infinite as a float32 rating
])
def test_mat_non_finite_ratings_are_refused(tmp_path, bad, reason):
    m = np.array([[bad, 0, 3], [0, 4, 1]], float)
    path = _mat(tmp_path, m=m)
    with pytest.raises(DataError, match="^" + re.escape(f"{path}: {reason}")):
        load_dataset("douban", tmp_path, tmp_path / "cache")


@pytest.mark.parametrize("value", [0.5, np.nan, -1.0])
def test_mat_masks_must_be_zero_or_one(tmp_path, value):
    path = _mat(tmp_path, o_test=np.array([[0, 0, 1], [0, 0, value]], float))
    with pytest.raises(DataError, match="^" + re.escape(f"{path}: key 'Otest' = ")
                                        + r".* at \(row 2, column 3\); expected a 0/1 mask"):
        load_dataset("douban", tmp_path, tmp_path / "cache")


def test_mat_truncated_or_inconsistent_files_are_refused(tmp_path):
    import h5py

    path = _mat(tmp_path, m=np.ones((40, 50)), o_train=np.eye(40, 50), o_test=np.zeros((40, 50)))
    path.write_bytes(path.read_bytes()[:-4000])
    with pytest.raises(DataError, match="^" + re.escape(f"{path}: not a MATLAB v7.3")):
        load_dataset("douban", tmp_path, tmp_path / "cache")
    _mat(tmp_path)
    with h5py.File(path, "r+") as fh:  # a sparse matrix whose row indices point outside it
        del fh["M"]
        group = fh.create_group("M")
        group["data"], group["ir"], group["jc"] = np.array([5.0, 4.0]), np.array([0, -7]), np.array([0, 1, 2, 2])
    with pytest.raises(DataError,
                       match="^" + re.escape(f"{path}: key 'M' holds inconsistent sparse data/ir/jc arrays")):
        load_dataset("douban", tmp_path, tmp_path / "cache")


def _ml100k_cfg(tmp_path):
    _write_dataset(tmp_path / "data", "ml-100k", b"4\t2\t3\t881250949")
    return load_config("fedgnn_paper", "ml-100k",
                       [f"data.data_dir={tmp_path / 'data'}", f"data.cache_dir={tmp_path / 'cache'}"]).data


def test_cache_key_covers_file_contents_not_just_size_and_mtime(tmp_path):
    cfg = _ml100k_cfg(tmp_path)
    first = prepare_partitions(cfg)
    path = tmp_path / "data" / "ml-100k" / "u1.base"
    st = path.stat()
    text = path.read_text()
    assert "1\t1\t5\t" in text
    path.write_text(text.replace("1\t1\t5\t", "1\t1\t2\t", 1))  # same size, one rating changed
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second = prepare_partitions(cfg)
    assert second != first
    assert UserPartitions(first).user(0).train_values[0] == 5 and UserPartitions(second).user(0).train_values[0] == 2
    assert prepare_partitions(cfg) == second  # unchanged contents: the cache is reused


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_an_interrupted_build_leaves_nothing_behind(tmp_path, monkeypatch, error):
    cfg = _ml100k_cfg(tmp_path)
    real_save, calls = np.save, []

    def save_then_fail(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise error
        real_save(*args, **kwargs)

    monkeypatch.setattr(partition.np, "save", save_then_fail)
    with pytest.raises(type(error)):
        prepare_partitions(cfg)
    assert len(calls) == 3 and list((tmp_path / "cache" / "partitions").iterdir()) == []
    monkeypatch.setattr(partition.np, "save", real_save)
    assert UserPartitions(prepare_partitions(cfg)).meta.num_users == 4


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-5])


def _bad_json(path):
    path.write_text('{"format": 1, "dataset": ')


def _wrong_count(path):
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "num_train": raw["num_train"] + 1}))


DAMAGE = {
    "missing npy": ("train_items.npy", lambda p: p.unlink()),
    "truncated npy": ("train_values.npy", _truncate),
    "empty npy": ("test_offsets.npy", lambda p: p.write_bytes(b"")),
    "bad meta json": ("meta.json", _bad_json),
    "missing meta json": ("meta.json", lambda p: p.unlink()),
    "meta disagrees with arrays": ("meta.json", _wrong_count),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_is_named_and_rebuilt(tmp_path, damage):
    cfg = _ml100k_cfg(tmp_path)
    directory = prepare_partitions(cfg)
    want = UserPartitions(directory).user(1)
    name, spoil = DAMAGE[damage]
    spoil(directory / name)
    with pytest.raises(DataError, match="^" + re.escape(f"partition cache {directory}")
                                        + ".*delete the folder to rebuild"):
        UserPartitions(directory)
    assert prepare_partitions(cfg) == directory  # rebuilt in place
    got = UserPartitions(directory).user(1)
    assert np.array_equal(got.train_items, want.train_items) and np.array_equal(got.test_values, want.test_values)
    assert [p.name for p in directory.parent.iterdir()] == [directory.name]  # no trash or .part- folder left
