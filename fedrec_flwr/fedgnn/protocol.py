"""The FedGNN wire format shared by the client and the strategy.

A message addresses the k users a node hosts (k = 1 on a deployed device; more when a
simulation multiplexes users onto nodes). Each user's part is its own block, so every user's upload
is validated, and protected, on its own; the blocks of all k users travel packed in a few arrays
(`frame_users`): [users (int64[k]), then per field: its k block sizes (int64[k]; any integer dtype is
read) and the k blocks concatenated along their first axis]. A message therefore has the same handful of arrays whatever
k is, which keeps Flower's per-array (de)serialisation off a simulated node's round.

Server -> client (fit "train" and evaluate): [*model weights, then users with one field: the global
rows of each user's anonymity set, in ascending item-id order].

Client -> server (fit, phase "train"): users with three fields: the model gradients flattened into
one vector (in the model's parameter order), the item ids, the item-row gradients; all protected
by LDP; ids are the whole anonymity set, sorted, so nothing marks the real items. Phase
"register": users with two fields, the ids of the user's anonymity set and its test-rating count
(int64[1], committed once: every later evaluation reply must report exactly the committed counts of its
users); its download is empty, or, with the popularity-matched sampler, [published item counts
(float32[num_items])]. Phase "popularity" (round 0, only with that
sampler; nothing down): users with one field, each an LDP report of the user's items
(uint8[num_items], `fedrec_flwr.privacy.popularity`).
num_examples is the number of users: a count of ratings would tell the server how many items a
user rated.

Graph expansion: in phases "expand-submit" / "expand-fetch" (and in every training round
when expansion.mode = trainable) the config carries the run's token key, the neighbour
service's address, run id and run secret; the client talks to the service directly and uploads nothing
to the recommendation server.

The config every message carries is a `RoundConfig`; its Flower keys are defined there, once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# array_bytes re-exported: part of the FedGNN wire API
from fedrec_flwr.messages import UploadRejected, array_bytes  # noqa: F401

PHASE_POPULARITY = "popularity"  # round 0, popularity-matched sampler only: every user sends an LDP item report
PHASE_REGISTER = "register"
PHASE_TRAIN = "train"
PHASE_EXPAND_SUBMIT = "expand-submit"  # every user sends embedding + item tokens to the neighbour service
PHASE_EXPAND_FETCH = "expand-fetch"  # every user fetches its anonymous neighbours' embeddings
# user-level DP: every node sends its users' clipped error sums, plus its noise share, through SecAgg+
PHASE_EVALUATE_SUM = "evaluate-sum"
PHASES = (PHASE_POPULARITY, PHASE_REGISTER, PHASE_TRAIN, PHASE_EXPAND_SUBMIT, PHASE_EXPAND_FETCH, PHASE_EVALUATE_SUM)


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
                        k["run_id"]: self.expansion.run_id, k["secret"]: self.expansion.secret,
                        k["retries"]: self.retries, k["refresh_neighbours"]: self.refresh_neighbours})
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


def frame_users(users, parts: list[list[np.ndarray]], fields: int) -> list[np.ndarray]:
    """[users, then per field: block sizes, blocks concatenated]: the k users' parts (each a list of
    `fields` arrays) packed into 1 + 2 * fields arrays."""
    users = users_array(users)
    if len(parts) != users.size or any(len(p) != fields for p in parts):
        raise ValueError(f"{users.size} users need {users.size} parts of {fields} arrays each")
    out = [users]
    for f in range(fields):
        blocks = [np.atleast_1d(p[f]) for p in parts]
        out.append(np.array([b.shape[0] for b in blocks], np.int64))
        out.append(np.concatenate(blocks) if blocks else np.zeros(0, np.float32))
    return out


def split_users(arrays: list[np.ndarray], fields: int,
                max_users: int | None = None) -> list[tuple[int, list[np.ndarray]]]:
    """[(user, its `fields` blocks)] of a message framed by `frame_users`; UploadRejected naming what is off.

    The framing is checked here (at most `max_users` unique integer user ids, one non-negative size
    per user and field, sizes that add up to the packed length); each user's blocks are then
    validated on their own. `max_users` is what the sending node may speak for: a message naming
    more is refused before any block is cut, so a few bytes of ids cannot cost the server a block,
    a log line and a rejection record per invented user."""
    if len(arrays) != 1 + 2 * fields:
        raise UploadRejected(f"message must have {1 + 2 * fields} arrays (users, then sizes and blocks of "
                             f"{fields} field(s)), got {len(arrays)}")
    users = np.asarray(arrays[0])
    if users.ndim != 1 or not np.issubdtype(users.dtype, np.integer):
        raise UploadRejected(f"message must start with a 1-D integer array of user ids, got "
                             f"{users.dtype} {users.shape}")
    if max_users is not None and users.size > max_users:
        raise UploadRejected(f"message names {users.size} users; the node may speak for at most {max_users}")
    if np.unique(users).size != users.size:
        raise UploadRejected("duplicate user ids in one message")
    per_field = []
    for f in range(fields):
        sizes, packed = np.asarray(arrays[1 + 2 * f]), np.asarray(arrays[2 + 2 * f])
        if sizes.shape != users.shape or not np.issubdtype(sizes.dtype, np.integer):
            raise UploadRejected(f"field {f}: sizes must be {users.size} integers, got {sizes.dtype} {sizes.shape}")
        if packed.ndim < 1 or (sizes.size and (sizes.min() < 0 or sizes.max() > packed.shape[0])) \
                or sum(sizes.tolist()) != packed.shape[0]:  # Python ints: an int64 sum could wrap around
            raise UploadRejected(f"field {f}: sizes {sizes[:5].tolist()}... do not add up to the "
                                 f"{packed.shape[0] if packed.ndim else 0} packed rows")
        per_field.append(np.split(packed, np.cumsum(sizes)[:-1]) if sizes.size else [])
    return [(int(u), [blocks[j] for blocks in per_field]) for j, u in enumerate(users)]


def frame_download(weights: list[np.ndarray], users: list[int], rows: list[np.ndarray]) -> list[np.ndarray]:
    """[*weights, users, rows per user packed]: what one node receives for its sampled users."""
    return [*weights, *frame_users(users, [[r] for r in rows], 1)]


def split_download(arrays: list[np.ndarray], num_weights: int) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """(model weights, users, rows per user) of a framed download; ValueError if the framing is off."""
    if len(arrays) < num_weights:
        raise ValueError(f"download has {len(arrays)} arrays, expected {num_weights} weights, users and rows")
    parts = split_users(list(arrays[num_weights:]), 1)
    return list(arrays[:num_weights]), users_array([u for u, _ in parts]), [blocks[0] for _, blocks in parts]


def frame_table_download(weights: list[np.ndarray], table: np.ndarray, users: list[int]) -> list[np.ndarray]:
    """[*weights, whole item table, users]: a user-DP download (privacy.mode = user_dp). Training asks every user a
    node hosts (the server must not choose who takes part); an evaluation names the users that score."""
    return [*weights, table, users_array(users)]


def split_table_download(arrays: list[np.ndarray], num_weights: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(model weights, item table, users) of a user-DP download; ValueError if it is not framed so."""
    if len(arrays) != num_weights + 2 or np.ndim(arrays[num_weights]) != 2 or np.ndim(arrays[-1]) != 1:
        raise ValueError(f"a user-DP download has {num_weights} model arrays, one 2-D item table and a user list; "
                         f"got {len(arrays)} arrays")
    return list(arrays[:num_weights]), np.asarray(arrays[num_weights], np.float32), np.asarray(arrays[-1], np.int64)


TRAIN_FIELDS = 3  # a training reply's fields per user: flat model gradients, item ids, item rows
TRAIN_GRADIENTS = 2  # index of the packed model gradients in a training reply


def frame_train_upload(users, parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    """A training reply: each user's [*model grads, ids, rows] as [flat grads, ids, rows], packed."""
    flat = [[np.concatenate([np.asarray(g).ravel() for g in p[:-2]]), p[-2], p[-1]] for p in parts]
    return frame_users(users, flat, TRAIN_FIELDS)


def model_gradients(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """One user's flat model gradients cut into the model's shapes; UploadRejected if the length is off."""
    flat = np.asarray(flat)
    sizes = [math.prod(s) for s in shapes]
    if flat.shape != (sum(sizes),):
        raise UploadRejected(f"model gradients have shape {flat.shape}, expected ({sum(sizes)},)")
    out, at = [], 0
    for size, shape in zip(sizes, shapes):
        out.append(flat[at : at + size].reshape(shape))
        at += size
    return out


def published_popularity(arrays: list[np.ndarray], num_items: int) -> np.ndarray | None:
    """The item counts a registration download publishes, checked (finite, one per item), or None if it has none."""
    if not arrays:
        return None
    counts = np.asarray(arrays[0], np.float32)
    if len(arrays) != 1 or counts.shape != (num_items,) or not np.all(np.isfinite(counts)):
        raise ValueError(f"registration download must be empty or one finite float array of {num_items} item counts")
    return counts


REGISTER_FIELDS = 2  # a registration's fields per user: the anonymity set, the committed test-rating count


def frame_registration(users: list[int], sets: list[np.ndarray], test_counts: list[int]) -> list[np.ndarray]:
    """A registration message: each user's anonymity set (int32 halves it) and its committed test-rating count."""
    return frame_users(users, [[np.asarray(ids).astype(np.int32), np.array([int(n)], np.int64)]
                               for ids, n in zip(sets, test_counts)], REGISTER_FIELDS)
