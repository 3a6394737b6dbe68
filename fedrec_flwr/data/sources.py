"""The datasets this project knows (each a `DatasetSpec`): names -> files, rating scale and loader.

Single-domain rating datasets feed FedGNN; multi-domain datasets (domains sharing user
ids) feed FPPDM. A name resolves files under the data directory first, then under the
download cache; with `download: true` missing files are fetched and verified.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Union

import numpy as np

from .download import RemoteFile, download_file
from .loaders import (
    load_disencdr_pair,
    load_gadtcdr,
    load_movielens_genres,
    load_ratings_dat,
    load_split_files,
    load_srgcnn_mat,
)
from .synthetic import make_synthetic, make_synthetic_multidomain
from .types import DataError, MultiDomainDataset, RatingDataset, RatingScale

AnyDataset = Union[RatingDataset, MultiDomainDataset]

_ML100K_ZIP = "https://files.grouplens.org/datasets/movielens/ml-100k.zip"
_IGMC_RAW = "https://raw.githubusercontent.com/muhanzhang/IGMC/5fa0e3cb1bdc46ffcb97fa6e0249a553e2e0b438/raw_data"
_GADTCDR_RAW = "https://raw.githubusercontent.com/fengzhu1/GA-DTCDR/11a1dc6fda5148c8b1ce412ed4e2f0c4f124e2d0/Data"
_DISENCDR_RAW = "https://raw.githubusercontent.com/cjx96/DisenCDR/4e6d60bad4d5185c99ab60423b48f87f88aa03a3/dataset"

# sha256 of the DisenCDR files (train.txt, test.txt) per folder
_DISENCDR_SHA = {
    "phone_electronic": ("a439eb3fdf4d08e58da1d86e1f711cf0acf59f28944d347ad4b3fb9454df54f9",
                         "a3d0d2fb03c25994c3509af3acc6eeca5009b00751f9b12e28fdf52843a027c6"),
    "electronic_phone": ("cb09610ab143478097937c235c4932fe39b5c664d434dd5abba3c5eb5d75f028",
                         "322a8e4c7b5d10e2a3d91dbb2d7833eaf2ba684f4c5109dc1ea4e6ee08119c46"),
    "cloth_sport": ("3e039ec9baff975cb47722c4704f7d2103c2bbf2a3c30ed2d264e17b69d4fd0a",
                    "0d034810261027b080d506399426d3eb4f26b4b90a121fe79ebaef246a82b1bd"),
    "sport_cloth": ("45c517a6fc7721f168411b69eb3f6e6ef896bbe06f599f6f7b4a5844ff925629",
                    "7b43d370047f23cbc6862188aba53b3a3241948255584a1f3f5c189118f16490"),
}
ALIASES = {"amazon-phone-elec": "disencdr:phone_electronic", "amazon-cloth-sport": "disencdr:cloth_sport"}


@dataclass(frozen=True)
class DatasetSpec:
    """How to get one dataset: its files, its rating scale (None when implicit) and its loader."""

    name: str
    kind: str  # "ratings" or "multidomain"
    files: tuple[RemoteFile, ...]
    scale: RatingScale | None
    load: Callable[[Path, int], AnyDataset]
    # public item metadata (data.item_features): the file, and how to read it for a loaded dataset
    item_features: tuple[RemoteFile, Callable[[Path, RatingDataset], np.ndarray]] | None = None


def _srgcnn(name: str, scale: RatingScale, sha: str | None) -> DatasetSpec:
    rel = f"{name}/training_test_dataset.mat"
    url = f"{_IGMC_RAW}/{name}/training_test_dataset.mat"
    return DatasetSpec(name, "ratings", (RemoteFile(rel, sha, url),), scale,
                       lambda root, seed: load_srgcnn_mat(name, root / rel, scale))


def _movielens_dat(name: str, scale: RatingScale) -> DatasetSpec:
    rel = f"{name}/ratings.dat"
    return DatasetSpec(name, "ratings", (RemoteFile(rel),), scale,
                       lambda root, seed: load_ratings_dat(name, root / rel, scale))


_ONE_TO_FIVE = RatingScale(1.0, 5.0, 1.0)
_HALF_TO_FIVE = RatingScale(0.5, 5.0, 0.5)

REGISTRY: dict[str, DatasetSpec] = {
    "ml-100k": DatasetSpec(
        "ml-100k",
        "ratings",
        (
            RemoteFile("ml-100k/u1.base", "ce253ec86c448b44fb3ba9a30d12dcfc2e9210cbde71efada3730c22e9ac212a",
                       _ML100K_ZIP, "ml-100k/u1.base"),
            RemoteFile("ml-100k/u1.test", "18c6014a4b2c7324f250a63f8904a7b16b2b19f911129e346141507b0cbac950",
                       _ML100K_ZIP, "ml-100k/u1.test"),
        ),
        _ONE_TO_FIVE,
        lambda root, seed: load_split_files("ml-100k", root / "ml-100k/u1.base", root / "ml-100k/u1.test", "\t",
                                            _ONE_TO_FIVE),
        (
            RemoteFile("ml-100k/u.item", "553841ebc7de3a0fd0d6b62a204ea30c1e651aacfb2814c7a6584ac52f2c5701",
                       _ML100K_ZIP, "ml-100k/u.item"),
            lambda path, ds: load_movielens_genres(path, ds.meta["raw_item_ids"]),
        ),
    ),
    "ml-1m": _movielens_dat("ml-1m", _ONE_TO_FIVE),
    "ml-10m": _movielens_dat("ml-10m", _HALF_TO_FIVE),
    "douban": _srgcnn("douban", _ONE_TO_FIVE, "1f4476321cbfe0f606e7e35d0695ca15447a1b0b2c811df130109b6cb9a067ae"),
    "flixster": _srgcnn("flixster", _HALF_TO_FIVE, None),
    "yahoo_music": _srgcnn("yahoo_music", RatingScale(1.0, 100.0, 1.0), None),
    "douban-book-music": DatasetSpec(
        "douban-book-music",
        "multidomain",
        (
            RemoteFile("douban_gadtcdr/douban_book/ratings.dat",
                       "cc1c191fabe2e05e95cd6dbe7be19d13ed3e1b27b80be2050e4f6b4e40945ddd",
                       f"{_GADTCDR_RAW}/douban_book/ratings.dat"),
            RemoteFile("douban_gadtcdr/douban_music/ratings.dat",
                       "40944be25f79e6cf80ab9acf0dca8f4b9b9fe2724a068702294608883ad46775",
                       f"{_GADTCDR_RAW}/douban_music/ratings.dat"),
        ),
        None,
        lambda root, seed: load_gadtcdr("douban-book-music", root / "douban_gadtcdr",
                                        ("douban_book", "douban_music"), seed),
    ),
}


def _disencdr_spec(pair: str) -> DatasetSpec:
    if pair.count("_") != 1:
        raise DataError(f"dataset 'disencdr:{pair}': expected 'disencdr:<a>_<b>' with two domain names")
    a, b = pair.split("_")
    files = []
    for folder in (f"{a}_{b}", f"{b}_{a}"):
        shas = _DISENCDR_SHA.get(folder, (None, None))
        for fname, sha in zip(("train.txt", "test.txt"), shas):
            rel = f"disencdr_amazon/{folder}/{fname}"
            files.append(RemoteFile(rel, sha, f"{_DISENCDR_RAW}/{folder}/{fname}" if sha else None))
    name = f"disencdr:{pair}"
    return DatasetSpec(name, "multidomain", tuple(files), None,
                       lambda root, seed: load_disencdr_pair(name, root / "disencdr_amazon", a, b))


def dataset_names() -> list[str]:
    """Every registered name, including aliases and the synthetic generators."""
    return sorted([*REGISTRY, *ALIASES, "synthetic", "synthetic-md2", "synthetic-md3", "disencdr:<a>_<b>"])


def dataset_family(name: str) -> str | None:
    """The family a dataset name belongs to ("disencdr" for every `disencdr:<a>_<b>` pair and its aliases,
    "synthetic-md" for every `synthetic-md<K>`), whose settings file applies to all its members; None
    for a dataset of its own."""
    name = ALIASES.get(name, name)
    if name.startswith("disencdr:"):
        return "disencdr"
    if name.startswith("synthetic-md"):
        return "synthetic-md"
    return None


def get_spec(name: str) -> DatasetSpec:
    """The spec of a registered real dataset; DataError listing the known names otherwise."""
    name = ALIASES.get(name, name)
    if name.startswith("disencdr:"):
        return _disencdr_spec(name.split(":", 1)[1])
    if name not in REGISTRY:
        raise DataError(f"unknown dataset '{name}'; known: {', '.join(dataset_names())}")
    return REGISTRY[name]


def resolve_root(spec: DatasetSpec, data_dir: Path, cache_dir: Path, download: bool) -> Path:
    """The directory under which all of `spec`'s files exist: the data dir, or the download cache."""
    if all((data_dir / f.relpath).is_file() for f in spec.files):
        return data_dir
    downloads = cache_dir / "downloads"
    if all((downloads / f.relpath).is_file() for f in spec.files):
        return downloads
    missing = [f for f in spec.files if not (data_dir / f.relpath).is_file()]
    if download:
        for f in spec.files:
            download_file(f, downloads)
        return downloads
    if data_dir.exists() and not data_dir.is_dir():
        raise DataError(f"data folder {data_dir}: not a directory; expected the folder holding the datasets "
                        "(--data-dir or data.data_dir, docs/datasets.md)")
    lines = [f"dataset '{spec.name}' is missing {len(missing)} file(s):"]
    for f in missing:
        where = (f" (downloadable: set data.download=true, or fetch {f.url}{' member ' + f.member if f.member else ''})"
                 if f.url and f.sha256 else "")
        lines.append(f"  put {f.relpath} at {data_dir / f.relpath}{where}")
    raise DataError("\n".join(lines))


def load_dataset(name: str, data_dir: str | Path, cache_dir: str | Path = ".cache/fedrec", download: bool = False,
                 seed: int = 0, synthetic: dict | None = None, item_features: bool = False) -> AnyDataset:
    """Load a dataset by registry name (synthetic ones are generated from `seed` and `synthetic`).

    With `item_features`, a rating dataset also carries its public item metadata as a feature
    matrix (ML-100K: genres; synthetic: planted genres); DataError for datasets without any.
    """
    ds = _load_ratings_or_domains(name, data_dir, cache_dir, download, seed, synthetic)
    if not item_features:
        if isinstance(ds, RatingDataset):
            ds.item_features = None  # generators (synthetic) make them with the data
        return ds
    if isinstance(ds, RatingDataset) and ds.item_features is not None:
        return ds
    spec = None if isinstance(ds, MultiDomainDataset) else get_spec(name)
    if spec is None or spec.item_features is None:
        with_features = sorted(["synthetic", *(n for n, s in REGISTRY.items() if s.item_features)])
        raise DataError(f"data.item_features = true, but dataset '{name}' has no public item features "
                        f"(datasets with some: {', '.join(with_features)})")
    file, read = spec.item_features
    root = resolve_root(replace(spec, files=(file,)), Path(data_dir), Path(cache_dir), download)
    ds.item_features = read(root / file.relpath, ds)
    return ds.validate(str(root / file.relpath))


def _load_ratings_or_domains(name: str, data_dir: str | Path, cache_dir: str | Path, download: bool, seed: int,
                             synthetic: dict | None) -> AnyDataset:
    if name == "synthetic":
        return make_synthetic(seed=seed, **(synthetic or {}))
    if name.startswith("synthetic-md"):
        try:
            k = int(name.removeprefix("synthetic-md"))
        except ValueError:
            raise DataError(f"unknown dataset '{name}'; expected synthetic-md<K> with an integer K >= 2") from None
        if k < 2:
            raise DataError(f"dataset '{name}': a multi-domain dataset needs K >= 2 domains")
        return make_synthetic_multidomain(seed=seed, num_domains=k)
    spec = get_spec(name)
    root = resolve_root(spec, Path(data_dir), Path(cache_dir), download)
    return spec.load(root, seed)
