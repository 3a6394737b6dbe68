"""FedGNN's model: a GNN over star graphs (GAT, GCN or GGNN, as PyG defines them) and a dot-product rating predictor.

The layer weights are PyG's, held without importing PyG (`star_layers`); the federated path runs them in dense
form (`dense_star`), and `forward` over a `StarBatch` runs PyG's own message passing on them (the centralized
reference and the test oracle), importing PyG on first use.
"""

from __future__ import annotations

import torch
from torch import nn

from .star_graph import StarBatch
from .star_layers import GNN_TYPES, layer_weights, pyg_layer


class StarGraphEncoder(nn.Module):
    r"""One message-passing layer over star graphs.

    gat:  h_i = x_i + \sum_j \alpha_{ij} W x_j      (attention over neighbours and self)
    gcn:  h_i = x_i + \sum_j (d_i d_j)^{-1/2} W x_j (symmetric normalisation, self loops)
    ggnn: h_i = GRU(\sum_j W x_j, x_i)              (gated update, one propagation step)
    """

    def __init__(self, kind: str, dim: int, dropout: float = 0.0, heads: int = 1):
        super().__init__()
        if kind not in GNN_TYPES:
            raise ValueError(f"model.gnn = {kind!r}; expected one of {GNN_TYPES}")
        self.kind = kind
        self.dropout = nn.Dropout(dropout)
        self.conv = layer_weights(kind, dim, heads)

    def reset_parameters(self) -> None:
        """Re-initialise the layer weights."""
        self.conv.reset_parameters()

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        """Node representations [N, dim] from node features [N, dim], by PyG's layer over these weights."""
        x = self.dropout(x)
        out = pyg_layer(self.conv)(x, edge_index)
        return out if self.kind == "ggnn" else x + out


class RatingGNN(nn.Module):
    """Encoder plus r_hat(u, i) = <h_u, h_i> + b, with b starting at the rating scale's midpoint.

    With `biases`, r_hat also adds v.x_u and w.x_i, read from the raw embeddings by the shared
    vectors v = `user_bias_map` and w = `item_bias_map` (starting at zero). Both biases then travel the paths
    the embeddings already take: the user's stays on its device, the item's moves with the item
    row (pseudo rows and LDP included), and v, w are model weights like any other. Their
    gradient on an item row points along w for every rater, so it adds up across users where
    the dot product's (along h_u, different per user) does not.

    With `item_bias` (model.item_bias: a per-item bias b_i) every item row has width dim + 1: its first dim columns are
    the item's embedding, the last one a free scalar bias b_i added to the item's predictions. The
    model splits the rows it is given (`split_rows`), so the bias's gradient is the last column of
    the item's gradient row and travels, clipped, noised and merged, with the rest of the row.
    """

    def __init__(self, kind: str, dim: int, dropout: float = 0.0, heads: int = 1, bias_init: float = 0.0,
                 biases: bool = False, num_item_features: int = 0, item_bias: bool = False,
                 population_bias: bool = False):
        super().__init__()
        self.dim, self.item_bias = dim, item_bias
        self.encoder = StarGraphEncoder(kind, dim, dropout, heads)
        self.bias = nn.Parameter(torch.tensor(float(bias_init)))
        self.user_bias_map = nn.Parameter(torch.zeros(dim)) if biases else None
        self.item_bias_map = nn.Parameter(torch.zeros(dim)) if biases else None
        # public item features enter as x_i = e_i + f_i W; W starts at zero (the paper's model)
        self.item_feature_map = nn.Parameter(torch.zeros(num_item_features, dim)) if num_item_features else None
        # model.population_bias: b_pop, the global bias of the population part only (`models.dense_star.
        # population_predict`), trained on each user's mean (b_pop + t_i - r)^2, never in the full prediction.
        # Registered after the other direct weights: without it, the order of the weights on the wire is unchanged
        self.population_bias = nn.Parameter(torch.tensor(float(bias_init))) if population_bias else None

    def item_input(self, rows: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """Item node inputs: the item embedding rows plus the mapped public features of those items.

        W is a shared model weight, so it learns from every user's (LDP-protected) model upload
        each round, while a single item row learns only from that item's few raters. An item's
        gradient row is unchanged (d x_i / d e_i = I), so pseudo rows and LDP see the same rows.
        """
        if self.item_feature_map is None:
            return rows
        if features is None:
            raise ValueError("this model takes public item features (data.item_features), but none were given")
        if self.item_bias:  # the features map into the embedding part; the bias column passes through
            return torch.cat([rows[..., : self.dim] + features @ self.item_feature_map, rows[..., self.dim :]], -1)
        return rows + features @ self.item_feature_map

    def split_rows(self, rows: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(embedding part [.., dim], bias [..] or None) of item rows: the last column is b_i with `item_bias`."""
        if rows is None or not self.item_bias:
            return rows, None
        if rows.shape[-1] != self.dim + 1:
            raise ValueError(f"item rows have width {rows.shape[-1]}, expected dim + 1 = {self.dim + 1} "
                             f"(model.item_bias)")
        return rows[..., : self.dim], rows[..., self.dim]

    def forward(
        self,
        batch: StarBatch,
        user_x: torch.Tensor,
        train_item_x: torch.Tensor,
        query_item_x: torch.Tensor | None = None,
        neighbour_x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted ratings for the train slots [T] and the query slots [Q] of the batch.

        Item rows have width dim, or dim + 1 with `item_bias` (the last column then adds b_i)."""
        train_item_x, train_b = self.split_rows(train_item_x)
        query_item_x, query_b = self.split_rows(query_item_x)
        d = user_x.shape[1]
        parts = [user_x, train_item_x]
        parts.append(query_item_x if query_item_x is not None else user_x.new_zeros((0, d)))
        parts.append(neighbour_x if neighbour_x is not None else user_x.new_zeros((0, d)))
        x = torch.cat(parts, 0)
        h = self.encoder(x, batch.edge_index)
        b, t, q = batch.num_users, batch.num_train, batch.num_query
        h_user = h[:b]
        pred_train = (h_user[batch.train_slot_user] * h[b : b + t]).sum(-1) + self.bias
        pred_query = (h_user[batch.query_slot_user] * h[b + t : b + t + q]).sum(-1) + self.bias
        if self.user_bias_map is not None:
            b_user, b_item = x[:b] @ self.user_bias_map, x[b : b + t + q] @ self.item_bias_map
            pred_train = pred_train + b_user[batch.train_slot_user] + b_item[:t]
            pred_query = pred_query + b_user[batch.query_slot_user] + b_item[t:]
        if train_b is not None:
            pred_train = pred_train + train_b
        if query_b is not None:
            pred_query = pred_query + query_b
        return pred_train, pred_query


def row_width(model_cfg) -> int:
    """Width of one item row on the wire and in the server's table: the embedding's dim, plus one column
    for the per-item bias b_i with model.item_bias. User embeddings and neighbour rows keep width dim."""
    return model_cfg.dim + (1 if model_cfg.item_bias else 0)


def build_model(model_cfg, bias_init: float, num_item_features: int = 0) -> RatingGNN:
    """The RatingGNN a ModelConfig describes (taking `num_item_features` public item features)."""
    return RatingGNN(model_cfg.gnn, model_cfg.dim, model_cfg.dropout, model_cfg.heads, bias_init, model_cfg.biases,
                     num_item_features, model_cfg.item_bias, model_cfg.population_bias)
