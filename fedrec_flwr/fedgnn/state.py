"""What a FedGNN device keeps of each of its users between rounds, apart from the model code that uses it,
so that a node's state store reads and writes it without importing the model (PyTorch Geometric)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class UserState:
    """What a device keeps between rounds: its private embedding, its fixed anonymity set,
    and the anonymous neighbour embeddings graph expansion gave it."""

    embedding: np.ndarray  # [d] float32, never sent to the recommendation server
    anonymity_ids: np.ndarray  # sorted int64: rated train items, test items, pseudo items
    neighbours: np.ndarray  # [n <= N, d] float32, from the neighbour service
    handle: str  # random anonymous name towards the neighbour service
    offset: float = 0.0  # model.user_offset: the user's private rating offset, never sent

    def copy(self) -> "UserState":
        """An independent copy."""
        return UserState(self.embedding.copy(), self.anonymity_ids.copy(), self.neighbours.copy(), self.handle,
                         self.offset)
