"""A privacy mode is a plug-in: one module with `check_config`, `Device` and `Server`, and one registry entry.

This module is such a mode, `ldp_everyone`: the paper's LDP protection, but every user trains in every round (the
server samples nobody out). It reuses the LDP mechanisms and changes what its own server side decides (`select`)
and what its config check refuses; the round core, the in-process runner and the config resolve it through
`fedrec_flwr.privacy_modes` alone, with no edit anywhere else.
"""

from __future__ import annotations

import pytest

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import ConfigError
from fedrec_flwr.fedgnn.modes import ldp
from fedrec_flwr.privacy_modes import PRIVACY_MODES, PrivacyMode


def check_config(cfg) -> None:
    """Everyone trains every round, so a sample size would be meaningless: it must name every user."""
    ldp.check_config(cfg)
    if cfg.federation.clients_per_round < cfg.data.synthetic.num_users:
        raise ConfigError("privacy.mode = 'ldp_everyone' trains every user each round; set "
                          "federation.clients_per_round to the number of users")


class Device(ldp.Device):
    """The LDP device, unchanged."""

    name = "ldp_everyone"


class Server(ldp.Server):
    """The LDP server, asking every live user each round."""

    name = "ldp_everyone"

    def select(self, logical_round: int, live: list[int]) -> list[int]:
        """Every user."""
        return sorted(live)


@pytest.fixture
def everyone_mode(monkeypatch):
    monkeypatch.setitem(PRIVACY_MODES, "ldp_everyone",
                        PrivacyMode("ldp_everyone", __name__, "LDP with every user in every round (a test mode)"))


def test_a_registered_mode_runs_through_the_unchanged_round_core(everyone_mode, tiny_cfg):
    rounds = 3
    cfg = tiny_cfg("privacy.mode=ldp_everyone", f"federation.rounds={rounds}", "federation.eval_every=3",
                   "federation.clients_per_round=60")
    out = run_in_process(cfg, log_every=0)
    assert out["uploads_per_user"] == {"max": rounds, "median": float(rounds), "total": 60 * rounds}
    sampled = run_in_process(tiny_cfg(f"federation.rounds={rounds}", "federation.eval_every=3",
                                      "federation.clients_per_round=20"), log_every=0)
    assert sampled["uploads_per_user"]["total"] == 20 * rounds  # the paper's mode samples 20 of the 60


def test_a_mode_s_own_config_check_and_an_unregistered_name_are_refused(everyone_mode, tiny_cfg):
    with pytest.raises(ConfigError, match="trains every user each round"):
        tiny_cfg("privacy.mode=ldp_everyone", "federation.clients_per_round=20")
    with pytest.raises(ConfigError, match=r"config key 'privacy.mode' = 'ldp_nobody'; expected one of \("):
        tiny_cfg("privacy.mode=ldp_nobody")
