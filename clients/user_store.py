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
        emb, ids, neighbours, handle = rec.to_numpy_ndarrays()
        return UserState(emb.astype(np.float32), ids.astype(np.int64), neighbours.astype(np.float32), bytes(handle).hex())

    def save(self, user: int, st: UserState) -> None:
        """Persist `user`'s state for the next round."""
        handle = np.frombuffer(bytes.fromhex(st.handle), np.uint8)
        self.state[self._key(user)] = ArrayRecord([st.embedding, st.anonymity_ids, st.neighbours, handle])


class MemoryStore:
    """The same interface over a dict: for tests and for driving clients without Flower."""

    def __init__(self):
        self.states: dict[int, UserState] = {}

    def load(self, user: int) -> UserState | None:
        """The stored state of `user`, or None."""
        st = self.states.get(user)
        return None if st is None else st.copy()

    def save(self, user: int, st: UserState) -> None:
        """Keep a copy of `user`'s state."""
        self.states[user] = st.copy()


_DOMAIN_KEYS = ("mu", "sigma_raw")


class DomainStateStore:
    """Keeps an FPPDM domain's model parameters in the node's RecordDict between rounds."""

    def __init__(self, state: RecordDict):
        self.state = state

    def load(self) -> dict[str, np.ndarray] | None:
        """The saved parameters, or None before the first round."""
        rec = self.state.get("fppdm.domain")
        return None if rec is None else dict(zip(_DOMAIN_KEYS, rec.to_numpy_ndarrays()))

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        """Persist the parameters for the next round."""
        self.state["fppdm.domain"] = ArrayRecord([arrays[k] for k in _DOMAIN_KEYS])
