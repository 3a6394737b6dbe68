"""The operator's node list: which authenticated SuperNode speaks for which users (FedGNN) or domain (FPPDM).

A JSON object {node id: [ids]}, written from the node ids that `flwr supernode register --format json`
printed for each device's key (config key `deployment.node_list`).
"""

from __future__ import annotations

import json
from pathlib import Path


class NodeListError(ValueError):
    """A node list file that cannot be used; the message names the file and what was expected."""


def load_node_list(path: str | Path, num_ids: int) -> dict[int, frozenset[int]]:
    """{node id: its users (FedGNN) or its domain index (FPPDM)} from the operator's JSON node list,
    checked: every id in [0, num_ids) and listed for one node only."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object {node id: [user ids or domain index]}")
        listing = {int(node): frozenset(int(u) for u in users) for node, users in raw.items()}
    except (OSError, ValueError, TypeError) as exc:
        raise NodeListError(f"deployment.node_list {path}: {exc}") from None
    seen: dict[int, int] = {}
    for node, users in listing.items():
        for u in users:
            if not 0 <= u < num_ids:
                raise NodeListError(f"deployment.node_list {path}: node {node} lists id {u}, outside [0, {num_ids})")
            if u in seen:
                raise NodeListError(f"deployment.node_list {path}: id {u} is listed for nodes {seen[u]} and {node}")
            seen[u] = node
    return listing
