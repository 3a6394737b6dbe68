"""The privacy-mode registry: one entry per FedGNN privacy mode (`privacy.mode`), naming the module that holds
its config check, its device-side mechanism (what a user registers, protects and uploads) and its server-side
mechanism (what the server checks, merges and accounts).

Like the algorithm registry (`fedrec_flwr.algorithms`), an entry names its module as a string and imports it on
first use, so the config layer reads the mode names here without importing the mechanisms (the arrows point
one way). Everything else asks the chosen mode's mechanisms; nothing outside this file and the mode modules
compares `privacy.mode` with a name (tests/test_import_graph.py checks it).

Adding a mode: one module under fedrec_flwr/fedgnn/modes/ with `check_config(cfg)` and the classes `Device`
and `Server` (the interfaces in fedrec_flwr/fedgnn/modes/base.py), and one entry in PRIVACY_MODES.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrivacyMode:
    """Where one privacy mode's parts live."""

    name: str
    module: str  # holds check_config(cfg), Device (device side) and Server (server side)
    summary: str  # one line for `fedrec config --explain` and error messages

    def part(self, which: str) -> Any:
        """The attribute `which` of the mode's module ("check_config", "Device" or "Server")."""
        return getattr(importlib.import_module(self.module), which)

    def check_config(self, cfg: Any) -> None:
        """ConfigError naming the key when a run's config combines this mode with a setting it cannot protect."""
        self.part("check_config")(cfg)

    def device(self, privacy: Any) -> Any:
        """The device-side mechanism for a run's privacy section (`modes.base.DeviceMechanism`)."""
        return self.part("Device")(privacy)


PRIVACY_MODES: dict[str, PrivacyMode] = {
    "ldp": PrivacyMode("ldp", "fedrec_flwr.fedgnn.modes.ldp",
                       "the paper's pseudo items and per-coordinate local DP on each user's upload"),
    "user_dp": PrivacyMode("user_dp", "fedrec_flwr.fedgnn.modes.user_dp",
                           "user-level DP: clipped whole updates with Gaussian noise shares, summed under SecAgg+"),
}

# the mode a deployed device takes part in unless its operator opts it into another (node config `privacy-mode`)
DEVICE_DEFAULT_MODE = "user_dp"


def privacy_mode(name: str) -> PrivacyMode:
    """The registry entry of `name`; ValueError listing the known names otherwise."""
    try:
        return PRIVACY_MODES[name]
    except KeyError:
        raise ValueError(f"unknown privacy mode '{name}'; expected one of {sorted(PRIVACY_MODES)}") from None
