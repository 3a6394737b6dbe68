"""Batched local star graphs: the user node, its rated items, query items and neighbour users.

FedGNN's client holds one star graph; the centralized reference and batched evaluation
put many users' star graphs side by side as one disconnected graph, so one GNN call
serves them all. Node layout of a batch of B users:

    [ B user nodes | train-item slots | query-item slots | neighbour-user slots ]

Edges: train item <-> its user (both ways), user -> query item (the user's representation
never sees its query items), neighbour -> user (neighbours connect to the user only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass
class StarBatch:
    """Index structure of a batch of star graphs (all LongTensors)."""

    num_users: int
    edge_index: torch.Tensor  # [2, E]
    train_slot_user: torch.Tensor  # [T] user position (0..B-1) of each train slot
    query_slot_user: torch.Tensor  # [Q]
    num_train: int
    num_query: int
    num_neighbours: int

    @property
    def num_nodes(self) -> int:
        """Total nodes in the batch graph."""
        return self.num_users + self.num_train + self.num_query + self.num_neighbours

    def to(self, device: torch.device) -> "StarBatch":
        """The same batch with its tensors on `device`."""
        return StarBatch(
            self.num_users, self.edge_index.to(device), self.train_slot_user.to(device),
            self.query_slot_user.to(device), self.num_train, self.num_query, self.num_neighbours,
        )


def _owner(counts: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(counts.size, dtype=np.int64), counts)


def build_star_batch(
    train_counts: Sequence[int], query_counts: Sequence[int] | None = None,
    neighbour_counts: Sequence[int] | None = None
) -> StarBatch:
    """Edges for B star graphs given, per user, how many train items, query items and neighbours it has."""
    t = np.asarray(train_counts, np.int64)
    b = t.size
    q = np.zeros(b, np.int64) if query_counts is None else np.asarray(query_counts, np.int64)
    n = np.zeros(b, np.int64) if neighbour_counts is None else np.asarray(neighbour_counts, np.int64)
    t_owner, q_owner, n_owner = _owner(t), _owner(q), _owner(n)
    t_nodes = b + np.arange(t_owner.size)
    q_nodes = b + t_owner.size + np.arange(q_owner.size)
    n_nodes = b + t_owner.size + q_owner.size + np.arange(n_owner.size)
    src = np.concatenate([t_nodes, t_owner, q_owner, n_nodes])
    dst = np.concatenate([t_owner, t_nodes, q_nodes, n_owner])
    return StarBatch(
        num_users=b,
        edge_index=torch.from_numpy(np.stack([src, dst])),
        train_slot_user=torch.from_numpy(t_owner),
        query_slot_user=torch.from_numpy(q_owner),
        num_train=int(t_owner.size),
        num_query=int(q_owner.size),
        num_neighbours=int(n_owner.size),
    )
