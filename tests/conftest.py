"""Shared fixtures: tiny configs and the location of the real data (tests needing it skip without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedrec_flwr.config import load_config

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip the test with the reason."""
    if not (SHARED_DATA / "README.md").is_file():
        pytest.skip(f"real datasets not found at {SHARED_DATA} (only present on development/CI machines)")
    return SHARED_DATA


@pytest.fixture
def tiny_cfg(tmp_path):
    """A small FedGNN config on a small synthetic dataset, caching under tmp_path."""
    def make(*overrides: str):
        return load_config("fedgnn_paper", "synthetic", [
            f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}",
            "data.synthetic.num_users=60", "data.synthetic.num_items=80", "data.synthetic.mean_degree=12",
            "model.dim=16", "privacy.pseudo_items=30", *overrides,
        ])
    return make
