"""The FedGNN wire format shared by the client and the strategy.

Server -> client (fit and evaluate): [*model weights, item rows] where the item rows are the
global embeddings of the user's anonymity set, in ascending item-id order. A client that
is not registered yet gets `phase = "register"` and the model weights only.

Client -> server (fit, phase "train"): [*model gradients, item ids, item-row gradients],
all protected by LDP; ids are the whole anonymity set, sorted, so nothing marks the real
items. Phase "register": [item ids] only. num_examples is always 1: a count of ratings
would tell the server how many items the user rated.

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
