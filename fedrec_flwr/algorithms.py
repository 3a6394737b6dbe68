"""The algorithm registry: one entry per algorithm name, naming its server factory, client factory,
deployment exporter and simulated node count.

Factories are named as "module:function" and imported on first use, so this registry imports
neither the Flower entry points nor `clients/` and `strategies/` (the arrows point one way), and a
new algorithm is one entry here plus its functions.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Algorithm:
    """Where an algorithm's parts live."""

    name: str
    server: str  # (cfg) -> flwr ServerAppComponents
    client: str  # (cfg, context, device) -> flwr Client
    nodes: str  # (cfg) -> how many SuperNodes a simulation needs
    node_data: str | None = None  # (cfg, out, users) -> catalogue path: per-node files for deployment
    preflight: str | None = None  # (cfg, nodes, project root) -> None: checks before Flower starts (`fedrec run`)
    privacy_modes: bool = False  # its devices run a FedGNN privacy mode (`fedrec_flwr.privacy_modes`), guarded

    def part(self, which: str) -> Callable[..., Any]:
        """The function named by field `which` ("server", "client", "nodes", "node_data" or "preflight")."""
        ref = getattr(self, which)
        if ref is None:
            raise ValueError(f"algorithm '{self.name}' has no {which}")
        module, _, function = ref.partition(":")
        return getattr(importlib.import_module(module), function)


ALGORITHMS: dict[str, Algorithm] = {
    "fedgnn": Algorithm("fedgnn", "fedrec_flwr.flower.server_app:fedgnn_components",
                        "fedrec_flwr.flower.client_app:fedgnn_client", "fedrec_flwr.flower.federation_size:user_nodes",
                        "fedrec_flwr.deployment.node_data:export_users", "fedrec_flwr.cli.preflight:fedgnn_preflight",
                        privacy_modes=True),
    "fppdm": Algorithm("fppdm", "fedrec_flwr.flower.server_app:fppdm_components",
                       "fedrec_flwr.flower.client_app:fppdm_client", "fedrec_flwr.flower.federation_size:domain_nodes",
                       "fedrec_flwr.deployment.node_data:export_domains", "fedrec_flwr.cli.preflight:fppdm_preflight"),
    "trivial": Algorithm("trivial", "fedrec_flwr.flower.server_app:trivial_components",
                         "fedrec_flwr.flower.client_app:trivial_client",
                         "fedrec_flwr.flower.federation_size:user_nodes"),
}


def get_algorithm(name: str) -> Algorithm:
    """The registry entry of `name`; ValueError listing the known names otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm '{name}'; expected one of {sorted(ALGORITHMS)}") from None
