"""Server checkpoints of a FedGNN run: save atomically, load without executing code, compare configs.

Checkpoints are read with `torch.load(weights_only=True)`, which unpickles only tensors and plain
containers, so a crafted file cannot run code on the server. A missing, empty, truncated or
foreign file gives one CheckpointError naming the file and what was expected.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from fedrec_flwr.fsutil import atomic_write

CHECKPOINT_FILE = "server.pt"
# what a FedGNN server checkpoint must hold
REQUIRED_KEYS = ("model", "items", "model_opt", "item_opt", "torch_rng", "logical_round", "train_rounds_done",
                 "rounds_not_applied", "history", "rejections", "uploads", "eval_rejected", "config")
# config sections that may differ between a killed run and its resumption
RESUME_FREE = ("checkpoint", "output_dir", "faults")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what was expected."""


class Checkpointer:
    """Save and load one run's server checkpoint in `folder`."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    @property
    def path(self) -> Path:
        """The checkpoint file."""
        return self.folder / CHECKPOINT_FILE

    def save(self, state: dict[str, Any]) -> Path:
        """Write `state` (tensors, numbers, strings and containers of them) atomically."""
        buf = io.BytesIO()
        torch.save(state, buf)
        return atomic_write(self.path, buf.getvalue())

    def load(self, map_location: torch.device | str = "cpu") -> dict[str, Any]:
        """The checkpoint's state, checked for the keys a FedGNN server checkpoint holds."""
        if not self.path.is_file():
            raise CheckpointError(f"checkpoint.resume is set but there is no checkpoint at {self.path}")
        try:
            state = torch.load(self.path, map_location=map_location, weights_only=True)
        except Exception as exc:  # noqa: BLE001  (torch raises many types for damaged or foreign files)
            raise CheckpointError(f"{self.path}: not a readable FedGNN checkpoint (expected a torch file of tensors "
                                  f"and plain values written by this app): {type(exc).__name__}: {exc}") from None
        if not isinstance(state, dict) or (missing := [k for k in REQUIRED_KEYS if k not in state]):
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"{self.path}: not a FedGNN server checkpoint (expected keys {list(REQUIRED_KEYS)}; "
                                  f"found {found}, missing {missing if isinstance(state, dict) else list(REQUIRED_KEYS)})")
        return state


def config_diff(now: dict[str, Any], then: dict[str, Any]) -> list[str]:
    """Config sections that differ between two runs, ignoring those a resumption may change."""
    keys = (set(now) | set(then)) - set(RESUME_FREE)
    return sorted(k for k in keys if now.get(k) != then.get(k))
