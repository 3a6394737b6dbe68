"""The FedGNN wire format shared by the client and the strategy.

A message addresses the k users a node hosts (k = 1 on a deployed device; more when a
simulation multiplexes users onto nodes). Each user's part is framed separately, so every
user's upload is validated, and protected, on its own.

Server -> client (fit "train" and evaluate): [*model weights, users (int64[k]), rows_1..rows_k]
where rows_j are the global embeddings of user j's anonymity set, in ascending item-id order.

Client -> server (fit, phase "train"): [users, then per user: *model gradients, item ids,
item-row gradients], all protected by LDP; ids are the whole anonymity set, sorted, so
nothing marks the real items. Phase "register": [users, ids_1..ids_k]; its download is empty, or,
with the popularity-matched sampler, [published item counts (float32[num_items])]. Phase
"popularity" (round 0, only with that sampler; nothing down): [users, report_1..report_k], each
an LDP report of the user's items (uint8[num_items], `fedrec_flwr.privacy.popularity`).
num_examples is the number of users: a count of ratings would tell the server how many items a
user rated.

Graph expansion: in phases "expand-submit" / "expand-fetch" (and in every training round
when expansion.mode = trainable) the config carries the run's token key, the neighbour
service's address, run id and run secret; the client talks to the service directly and uploads nothing
to the recommendation server.

The config every message carries is a `RoundConfig`; its Flower keys are defined there, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedrec_flwr.messages import UploadRejected, array_bytes  # noqa: F401  (re-exported: part of the FedGNN wire API)

PHASE_POPULARITY = "popularity"  # round 0, popularity-matched sampler only: every user sends an LDP item report
PHASE_REGISTER = "register"
PHASE_TRAIN = "train"
PHASE_EXPAND_SUBMIT = "expand-submit"  # every user sends embedding + item tokens to the neighbour service
PHASE_EXPAND_FETCH = "expand-fetch"  # every user fetches its anonymous neighbours' embeddings
PHASES = (PHASE_POPULARITY, PHASE_REGISTER, PHASE_TRAIN, PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH)


@dataclass(frozen=True)
class ExpansionLink:
    """What the server hands clients for graph expansion: the token key, where the service is, and the
    run's secret (the service refuses submits and fetches without it; "" only for an unauthenticated
    in-process service). `close_run` is server-side only, never sent: it ends the run at the service."""

    key: bytes = field(repr=False)
    address: str
    run_id: str
    secret: str = field(default="", repr=False)
    close_run: Callable[[], None] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class RoundConfig:
    """The config of one server message: phase, logical round, the client-state checkpoint marks, and
    (expansion rounds, or every round of trainable expansion) the neighbour-service link."""

    phase: str
    round: int
    ckpt: int = 0  # last logical round the server checkpointed: clients keep their state as of then
    resume_from: int = -1  # logical round a resumed run continues after (-1: not resumed)
    expansion: ExpansionLink | None = None
    retries: int = 3  # neighbour-service retries
    refresh_neighbours: bool = False  # trainable expansion: re-expand before training

    # Flower config keys (flat scalars), defined once
    _KEYS = {"phase": "phase", "round": "round", "ckpt": "ckpt", "resume_from": "resume_from",
             "key": "nb_key", "address": "nb_address", "run_id": "nb_run", "retries": "nb_retries",
             "refresh_neighbours": "nb_refresh", "secret": "nb_secret"}

    def to_flower(self) -> dict:
        """The flat scalar dict Flower carries in FitIns / EvaluateIns."""
        k = self._KEYS
        out = {k["phase"]: self.phase, k["round"]: self.round, k["ckpt"]: self.ckpt, k["resume_from"]: self.resume_from}
        if self.expansion is not None:
            out.update({k["key"]: self.expansion.key, k["address"]: self.expansion.address,
                        k["run_id"]: self.expansion.run_id, k["secret"]: self.expansion.secret, k["retries"]: self.retries,
                        k["refresh_neighbours"]: self.refresh_neighbours})
        return out

    @classmethod
    def from_flower(cls, config) -> "RoundConfig":
        """Parse a received config; ValueError naming the key if it is missing or of the wrong kind."""
        k = cls._KEYS
        try:
            phase = str(config[k["phase"]])
            link = None
            if k["address"] in config:
                link = ExpansionLink(bytes(config[k["key"]]), str(config[k["address"]]), str(config[k["run_id"]]),
                                     str(config.get(k["secret"], "")))
            out = cls(phase, int(config.get(k["round"], 0)), int(config.get(k["ckpt"], 0)),
                      int(config.get(k["resume_from"], -1)), link, int(config.get(k["retries"], 3)),
                      bool(config.get(k["refresh_neighbours"], False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"server config {dict(config)!r} is malformed: {type(exc).__name__}: {exc}") from None
        if phase not in PHASES:
            raise ValueError(f"server config phase {phase!r}; expected one of {PHASES}")
        return out


def users_array(users) -> np.ndarray:
    """The user ids that head a framed message."""
    return np.asarray(list(users), np.int64).reshape(-1)


def frame_download(weights: list[np.ndarray], users: list[int], rows: list[np.ndarray]) -> list[np.ndarray]:
    """[*weights, users, rows per user]: what one node receives for its sampled users."""
    return [*weights, users_array(users), *rows]


def split_download(arrays: list[np.ndarray], num_weights: int) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """(model weights, users, rows per user) of a framed download; ValueError if the framing is off."""
    if len(arrays) < num_weights + 1:
        raise ValueError(f"download has {len(arrays)} arrays, expected >= {num_weights + 1} (weights, users, rows)")
    users = np.asarray(arrays[num_weights])
    rows = list(arrays[num_weights + 1 :])
    if users.ndim != 1 or len(rows) != users.size:
        raise ValueError(f"download names {users.size} users but carries {len(rows)} row blocks")
    return list(arrays[:num_weights]), users.astype(np.int64), rows


def published_popularity(arrays: list[np.ndarray], num_items: int) -> np.ndarray | None:
    """The item counts a registration download publishes, checked (finite, one per item), or None if it has none."""
    if not arrays:
        return None
    counts = np.asarray(arrays[0], np.float32)
    if len(arrays) != 1 or counts.shape != (num_items,) or not np.all(np.isfinite(counts)):
        raise ValueError(f"registration download must be empty or one finite float array of {num_items} item counts")
    return counts


def split_upload(arrays: list[np.ndarray], per_user: int) -> list[tuple[int, list[np.ndarray]]]:
    """[(user, its arrays)] of a framed upload with `per_user` arrays per user; UploadRejected if malformed."""
    if not arrays:
        raise UploadRejected("empty upload")
    users = np.asarray(arrays[0])
    if users.ndim != 1 or not np.issubdtype(users.dtype, np.integer):
        raise UploadRejected(f"upload must start with a 1-D integer array of user ids, got {users.dtype} {users.shape}")
    if len(arrays) != 1 + per_user * users.size:
        raise UploadRejected(f"upload names {users.size} users and needs {1 + per_user * users.size} arrays, got {len(arrays)}")
    if np.unique(users).size != users.size:
        raise UploadRejected("duplicate user ids in one upload")
    return [(int(u), list(arrays[1 + j * per_user : 1 + (j + 1) * per_user])) for j, u in enumerate(users)]
