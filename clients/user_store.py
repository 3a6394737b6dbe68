"""Per-user state kept in a Flower node's own state (Context.state), never sent anywhere."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from clients.fedgnn import UserState


class NodeStateStore:
    """Saves and loads each hosted user's UserState under its own key in the node's RecordDict."""

    def __init__(self, state: RecordDict):
        self.state = state

    @staticmethod
    def _key(user: int) -> str:
        return f"fedgnn.user.{user}"

    def load(self, user: int) -> UserState | None:
        """The stored state of `user`, or None on its first message."""
        rec = self.state.get(self._key(user))
        if rec is None:
            return None
        emb, ids = rec.to_numpy_ndarrays()
        return UserState(emb.astype(np.float32), ids.astype(np.int64))

    def save(self, user: int, st: UserState) -> None:
        """Persist `user`'s state for the next round."""
        self.state[self._key(user)] = ArrayRecord([st.embedding, st.anonymity_ids])


class MemoryStore:
    """The same interface over a dict: for tests and for driving clients without Flower."""

    def __init__(self):
        self.states: dict[int, UserState] = {}

    def load(self, user: int) -> UserState | None:
        """The stored state of `user`, or None."""
        st = self.states.get(user)
        return None if st is None else UserState(st.embedding.copy(), st.anonymity_ids.copy())

    def save(self, user: int, st: UserState) -> None:
        """Keep a copy of `user`'s state."""
        self.states[user] = UserState(st.embedding.copy(), st.anonymity_ids.copy())
