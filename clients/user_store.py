"""Per-user state kept on the device: in the Flower node's own state (Context.state), and on the
device's disk when runs must survive a restart. Never sent to the recommendation server."""

from __future__ import annotations

import io
import json
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedrec_flwr.fedgnn.state import UserState, decode_state, encode_state
from fedrec_flwr.fsutil import atomic_write, exclusive_lock


def _pack(st: UserState) -> list[np.ndarray]:
    return [st.embedding, st.anonymity_ids, st.neighbours, np.frombuffer(bytes.fromhex(st.handle), np.uint8),
            np.array([st.offset], np.float64)]


def _unpack(arrays) -> UserState:
    emb, ids, neighbours, handle, offset = arrays
    return UserState(np.asarray(emb, np.float32), np.asarray(ids, np.int64), np.asarray(neighbours, np.float32),
                     bytes(np.asarray(handle, np.uint8)).hex(), float(np.asarray(offset, np.float64).reshape(-1)[0]))


class UserStateFiles:
    """Round-versioned user states on the device's disk, so a killed run can resume.

    `save` writes `u<user>/r<round>.npz` and keeps only that version and the newest one at or
    before the server's last checkpoint round; `load(user, at_most)` returns the newest
    version at or before a checkpoint round, which is the state an uninterrupted run had there.
    """

    _NAME = re.compile(r"r(\d+)\.npz$")

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def _versions(self, user: int) -> list[tuple[int, Path]]:
        folder = self.root / f"u{user}"
        if not folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := self._NAME.search(p.name))]
        return sorted(found)

    def has(self, user: int) -> bool:
        """Whether any saved version exists."""
        return bool(self._versions(user))

    def save(self, user: int, st: UserState, server_round: int, checkpoint_round: int) -> None:
        """Write the state as of `server_round`; prune versions no resume can need."""
        buf = io.BytesIO()
        np.savez(buf, *_pack(st))
        atomic_write(self.root / f"u{user}" / f"r{server_round:07d}.npz", buf.getvalue())
        versions = self._versions(user)
        at_ckpt = [v for v in versions if v[0] <= checkpoint_round]
        keep = {server_round, *([at_ckpt[-1][0]] if at_ckpt else [])}
        for r, path in versions:
            if r not in keep:
                path.unlink(missing_ok=True)

    def load(self, user: int, at_most: int) -> UserState | None:
        """The newest saved state at or before round `at_most`, or None."""
        older = [p for r, p in self._versions(user) if r <= at_most]
        if not older:
            return None
        with np.load(older[-1]) as z:
            return _unpack([z[f"arr_{i}"] for i in range(5)])


class NodeStateStore:
    """Each hosted user's UserState under its own key in the node's RecordDict (+ files, if given).

    `begin_round(round_config)` takes from the server's message the last checkpoint round and, in
    a resumed run, the round it resumes from.
    """

    def __init__(self, state: RecordDict, files: UserStateFiles | None = None, draws_file: Path | None = None,
                 sets_file: Path | None = None):
        """`draws_file`: where a device with its own disk (`state-dir`) keeps the rounds its users drew for, so
        that even across runs and restarts a round the server repeats never repeats a draw; `sets_file`: where it
        keeps the anonymity set each user committed to (`fedgnn.user.FedGNNUser.register`)."""
        self.state, self.files, self.draws_file, self.sets_file = state, files, draws_file, sets_file
        self.checkpoint_round, self.resume_from = 0, -1

    @staticmethod
    def _key(user: int) -> str:
        return f"fedgnn.user.{user}"

    def begin_round(self, round_config) -> None:
        """Note the checkpoint/resume rounds the server announced (a fedgnn.protocol.RoundConfig)."""
        self.checkpoint_round = round_config.ckpt
        self.resume_from = round_config.resume_from

    def load(self, user: int) -> UserState | None:
        """The state of `user`: this run's, else (when resuming) the saved one at the checkpoint."""
        rec = self.state.get(self._key(user))
        if rec is not None:
            return decode_state(rec["state"])
        if self.files is not None and self.resume_from >= 0:
            return self.files.load(user, self.resume_from)
        return None

    def save(self, user: int, st: UserState, server_round: int = 0) -> None:
        """Keep `user`'s state for its next round (and on disk, versioned by round)."""
        self.state[self._key(user)] = ConfigRecord({"state": encode_state(st)})
        if self.files is not None and (server_round > 0 or not self.files.has(user)):
            self.files.save(user, st, server_round, self.checkpoint_round)

    def draw_attempt(self, user: int, server_round: int) -> int:
        """The times `user` drew for `server_round` before (`fedgnn.user.UserStore.draw_attempt`). Where the device
        has a disk, `draws_file` is the one count, read and written under an exclusive lock at every draw (before
        the draw is used): two runs the server interleaves on one device, or two processes, never get the same
        attempt, so never the same coins or noise. Otherwise the node state counts for the run."""
        key = f"{user}:{server_round}"
        with self._record(self.draws_file, _DRAWS_KEY) as counts:
            seen = int(counts.get(key, 0))
            counts[key] = seen + 1
        return seen

    def committed_set(self, user: int) -> np.ndarray | None:
        """The anonymity set `user` committed to on this device: from `sets_file` (any run), else this run's."""
        with self._record(self.sets_file, _SETS_KEY) as sets:
            ids = sets.get(str(user))
        return None if ids is None else np.asarray(list(ids), np.int64)

    def commit_set(self, user: int, ids: np.ndarray) -> None:
        """Keep `user`'s anonymity set (on the device's disk where it has one, under a lock)."""
        with self._record(self.sets_file, _SETS_KEY) as sets:
            sets[str(user)] = [int(i) for i in np.asarray(ids).ravel()]

    @contextmanager
    def _record(self, path: Path | None, key: str):
        """A dict to read and update: the JSON file `path` under an exclusive lock where the device has a disk (the
        one record across runs and processes), else the node state's `key` record (this run's); written back after."""
        if path is not None:
            with exclusive_lock(path.with_name(path.name + ".lock")):
                record = json.loads(path.read_text()) if path.is_file() else {}
                yield record
                atomic_write(path, json.dumps(record).encode())
            return
        # updated in place: the record grows by one entry per user and round drawn, so a copy at every draw would
        # make each round slower than the one before
        record = self.state.config_records.get(key)
        if record is None:
            record = self.state.config_records[key] = ConfigRecord()
        yield record


_DRAWS_KEY = "fedgnn.draws"  # user:round -> draws made for that round (NodeStateStore.draw_attempt)
_SETS_KEY = "fedgnn.sets"  # user -> its committed anonymity set, for a node without a disk


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
