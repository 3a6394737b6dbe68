"""The FedGNN wire format shared by the client and the strategy.

A message addresses the k users a node hosts (k = 1 on a deployed device; more when a
simulation multiplexes users onto nodes). Each user's part is framed separately, so every
user's upload is validated, and protected, on its own.

Server -> client (fit "train" and evaluate): [*model weights, users (int64[k]), rows_1..rows_k]
where rows_j are the global embeddings of user j's anonymity set, in ascending item-id order.

Client -> server (fit, phase "train"): [users, then per user: *model gradients, item ids,
item-row gradients], all protected by LDP; ids are the whole anonymity set, sorted, so
nothing marks the real items. Phase "register" (config only, no arrays down):
[users, ids_1..ids_k]. num_examples is the number of users: a count of ratings would tell
the server how many items a user rated.

Graph expansion: in phases "expand-submit" / "expand-fetch" (and in every training round
when expansion.mode = trainable) the config carries the run's token key, the neighbour
service's address and run id; the client talks to the service directly and uploads nothing
to the recommendation server.
"""

from __future__ import annotations

import numpy as np

PHASE_REGISTER = "register"
PHASE_TRAIN = "train"
PHASE_EXPAND_SUBMIT = "expand-submit"  # every user sends embedding + item tokens to the neighbour service
PHASE_EXPAND_FETCH = "expand-fetch"  # every user fetches its anonymous neighbours' embeddings


def array_bytes(arrays: list[np.ndarray]) -> int:
    """Payload size of a list of arrays, as Flower serialises them (raw bytes)."""
    return int(sum(np.asarray(a).nbytes for a in arrays))


class UploadRejected(ValueError):
    """A client update that fails validation; the message is the reason that gets logged."""


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
