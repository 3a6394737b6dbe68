"""What every algorithm's messages share: the rejection error and the payload size."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class UploadRejected(ValueError):
    """A client message that fails validation; the message is the reason that gets logged and counted."""


def array_bytes(arrays: list[np.ndarray]) -> int:
    """Payload size of a list of arrays, as Flower serialises them (raw bytes)."""
    return int(sum(np.asarray(a).nbytes for a in arrays))


@dataclass
class NodeReply:
    """What one node sent back in a round, for a round core: its id and its arrays (fit) or metrics (evaluate)."""

    node_id: int
    arrays: list[np.ndarray] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
