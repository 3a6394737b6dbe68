"""Which node may speak for which user: the server's node-user binding.

A user's registration and every later upload are accepted only from the node that the user is
bound to. Ids outside the dataset are refused, and a user already bound to one node cannot be
claimed by another. `entitled(node_id)`, when given, narrows what a node may claim at all (for
example the users an operator's node list assigns to an authenticated SuperNode).
"""

from __future__ import annotations

from typing import Callable, Collection

from fedrec_flwr.messages import UploadRejected


class UserRegistry:
    """Node-user bindings of one run."""

    def __init__(self, num_users: int, entitled: Callable[[int], Collection[int] | None] | None = None):
        self.num_users = num_users
        self._entitled = entitled
        self._node_of: dict[int, int] = {}
        self._users_of: dict[int, list[int]] = {}

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
