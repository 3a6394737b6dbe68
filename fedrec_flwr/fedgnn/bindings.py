"""Which node may speak for which user: the server's node-user binding.

A user's registration and every later upload are accepted only from the node that the user is
bound to. Ids outside the dataset are refused, and a user already bound to one node cannot be
claimed by another. Who may claim what:
- deployment: the operator's node list (`deployment.node_list`, a JSON file {node id: [users]},
  the node ids that `flwr supernode register --format json` printed for each device's key) binds
  each authenticated SuperNode to its users; a node that is not listed registers nobody;
- simulation: partition p hosts users pU .. pU+U-1 (U = simulation.users_per_node, or with 0 set from the
  federation's size at the first round, `set_block_size`), so a node must claim exactly one such block, and
  each block once.
"""

from __future__ import annotations

import logging
from typing import Callable, Collection

from fedrec_flwr.config import DeploymentConfig
from fedrec_flwr.messages import UploadRejected
from fedrec_flwr.node_list import load_node_list

log = logging.getLogger("fedrec_flwr.fedgnn")


def listed(node_list: dict[int, frozenset[int]]) -> Callable[[int], Collection[int]]:
    """Entitlement from an operator's node list: a node may claim the users listed for it (none if unlisted)."""
    return lambda node_id: node_list.get(node_id, frozenset())


class NodeBindings:
    """Node-user bindings of one run."""

    def __init__(self, num_users: int, entitled: Callable[[int], Collection[int] | None] | None = None,
                 block_size: int = 0):
        self.num_users = num_users
        self._entitled = entitled
        self._block = block_size  # > 0 (simulation): a node claims exactly one block of this many users
        self._node_of: dict[int, int] = {}
        self._users_of: dict[int, list[int]] = {}

    def set_block_size(self, block_size: int) -> None:
        """A simulation's block (users per node) once the federation's size is known (`users_per_node` 0, auto)."""
        self._block = int(block_size)

    @property
    def run_nodes(self) -> int:
        """How many nodes the run has: one per block of users in a simulation, one per user in a deployment."""
        return -(-self.num_users // self._block) if self._block else self.num_users

    def check_claim(self, node_id: int, users: list[int]) -> None:
        """UploadRejected unless `node_id` may register every one of `users`."""
        allowed = self._entitled(node_id) if self._entitled is not None else None
        for u in users:
            if not 0 <= u < self.num_users:
                raise UploadRejected(f"user {u} is outside the dataset's users [0, {self.num_users})")
            if allowed is not None and u not in allowed:
                raise UploadRejected(f"user {u} is not assigned to node {node_id}")
            if self._node_of.get(u, node_id) != node_id:
                raise UploadRejected(f"user {u} is already registered by another node")
        if self._block and users:
            start = min(users) - min(users) % self._block
            block = list(range(start, min(start + self._block, self.num_users)))
            if sorted(users) != block:
                raise UploadRejected(f"a simulated node hosts exactly users {start}..{block[-1]} of its partition "
                                     f"(simulation.users_per_node = {self._block}); it claimed {len(users)} others")

    def claim_limit(self, node_id: int) -> int:
        """The most users one registration (or popularity report) from `node_id` may name: its listed users
        (at least 1, so that a node claiming a user it is not listed for is told which), its partition's
        block, or (first claim wins) every user."""
        allowed = self._entitled(node_id) if self._entitled is not None else None
        if allowed is not None:
            return max(len(allowed), 1)
        return self._block or self.num_users

    def users_of(self, node_id: int) -> list[int]:
        """The users bound to `node_id`, sorted (empty for a node that registered nobody)."""
        return list(self._users_of.get(node_id, []))

    def bind(self, node_id: int, users: list[int]) -> None:
        """Bind `users` to `node_id` (after `check_claim`)."""
        for u in users:
            self._node_of[u] = node_id
        self._users_of[node_id] = sorted(set(self._users_of.get(node_id, [])) | set(users))

    def node_of(self, user: int) -> int | None:
        """The node a user is bound to, or None."""
        return self._node_of.get(user)

    def hosts(self, node_id: int, user: int) -> bool:
        """True if `user` is bound to `node_id`."""
        return self._node_of.get(user) == node_id

    @property
    def nodes(self) -> list[int]:
        """Nodes that registered at least one user."""
        return list(self._users_of)

    def live_users(self, connected: Collection[int]) -> list[int]:
        """Registered users whose node is connected now, sorted."""
        return sorted(u for u, n in self._node_of.items() if n in connected)

    def by_node(self, users: list[int]) -> dict[int, list[int]]:
        """`users` grouped by the node hosting them (one message per node), each group in user order."""
        grouped: dict[int, list[int]] = {}
        for u in sorted(users):
            grouped.setdefault(self._node_of[u], []).append(u)
        return grouped


def bindings_for(num_users: int, deployment: DeploymentConfig, catalogue: str, users_per_node: int) -> NodeBindings:
    """The bindings a run calls for: the operator's node list (`deployment.node_list`), the simulation's
    partition blocks of `users_per_node` (`simulation.users_per_node`), or (a deployment without a node
    list, known by its `data.catalogue`) first claim wins, with a warning."""
    if deployment.node_list:
        return NodeBindings(num_users, listed(load_node_list(deployment.node_list, num_users)))
    if catalogue:
        log.warning("deployment without deployment.node_list: any SuperNode may register any unclaimed user")
        return NodeBindings(num_users)
    return NodeBindings(num_users, block_size=users_per_node)
