"""GNN models on PyTorch Geometric."""

from .rating_gnn import GNN_TYPES, RatingGNN, StarGraphEncoder, build_model, row_width
from .star_graph import StarBatch, build_star_batch

__all__ = ["GNN_TYPES", "RatingGNN", "StarBatch", "StarGraphEncoder", "build_model", "build_star_batch", "row_width"]
