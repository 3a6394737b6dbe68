"""What `make install` puts into site-packages: the project's own package only. strategies/ and clients/ (Flower's
adapters) travel inside the Flower app, whose folder Flower puts on sys.path (`flwr run` stages it; a SuperNode
installs the FAB), and benchmarks/ runs from the checkout (`python -m benchmarks...`); none of them may land in a
user's site-packages under a generic name, where it would shadow or be shadowed by another package."""

from __future__ import annotations

import ast
import glob
import re
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_project_package_is_installed():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(where=str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "fedrec_flwr" in packages and "fedrec_flwr.fedgnn.modes" in packages
    assert [p for p in packages if p.split(".")[0] != "fedrec_flwr"] == []


def test_the_editable_install_maps_no_generic_top_level_name():
    finders = [f for path in sys.path for f in glob.glob(str(Path(path) / "__editable___fedrec_flwr*_finder.py"))]
    if not finders:
        pytest.skip("fedrec-flwr is not installed in editable mode here (make install does that)")
    mapping = re.search(r"MAPPING[^=]*=\s*(\{[^}]*\})", Path(finders[0]).read_text())
    assert mapping is not None and set(ast.literal_eval(mapping.group(1))) == {"fedrec_flwr"}
