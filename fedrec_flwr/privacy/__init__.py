"""Privacy mechanisms: LDP (clip + Laplace) and pseudo interacted items."""

from .ldp import clip_linf, privatize
from .pseudo_items import (
    ledoit_wolf_shrinkage,
    num_pseudo,
    pseudo_gradient_rows,
    sample_pseudo_items,
)

__all__ = ["clip_linf", "ledoit_wolf_shrinkage", "num_pseudo", "privatize", "pseudo_gradient_rows",
           "sample_pseudo_items"]
