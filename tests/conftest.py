"""Shared fixtures: tiny configs and the location of the real data (tests needing it skip without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedrec_flwr.config import load_config
from fedrec_flwr.privacy.device_secret import DeviceSecret

TEST_SECRET = DeviceSecret(bytes(range(32)))  # a fixed device secret: tests that build Flower clients replay exactly


def fixed_secrets(folder: Path) -> Path:
    """A `simulation.device_secrets` file in `folder` holding TEST_SECRET: runs that use it replay exactly, on every
    machine and every test session (a file drawn from the OS would give each session other numbers)."""
    path = folder / "device-secrets"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(TEST_SECRET.hex_for_node_state() + "\n")
        path.chmod(0o600)
    return path


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
            "model.dim=16", "privacy.pseudo_items=30", f"simulation.device_secrets={fixed_secrets(tmp_path)}",
            "simulation.users_per_node=1",  # one node per user, as a deployment has (the default 0 sizes it)
            *overrides,
        ])
    return make
