"""RatingGNN's star-graph layers in dense, batched form, with weights of each user's own.

A node that hosts many users must still give each of them its own gradient of the shared model
(every upload is clipped and noised alone). PyG's layers compute one gradient for a whole batch,
so here the same three layers are written out for a batch of B star graphs laid side by side as
padded tensors, with every weight carrying a leading user axis: the gradient of a user's loss
with respect to its own copy is that user's gradient, exactly as if it had run alone.

A star graph is small enough to write out by hand (see `star_graph`): the user node receives
from its rated items and its neighbours, each item from its user, and GAT and GCN add self
loops. The functions below give the same numbers as `StarGraphEncoder` on `build_star_batch`
graphs up to float rounding (tests/test_batched_users.py checks all three kinds).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .rating_gnn import RatingGNN


class DenseStars(NamedTuple):
    """B padded star graphs: user rows [B, d], item rows [B, T, d], neighbour rows [B, N, d], and
    float masks [B, T] and [B, N] that are 1 on real slots and 0 on padding."""

    user: torch.Tensor
    items: torch.Tensor
    neighbours: torch.Tensor
    item_mask: torch.Tensor
    neighbour_mask: torch.Tensor


def per_user_copies(model: RatingGNN, count: int) -> dict[str, torch.Tensor]:
    """`count` independent copies of every model parameter, stacked on a new leading axis (leaf tensors)."""
    return {name: p.detach().unsqueeze(0).repeat(count, *([1] * p.dim())).requires_grad_(True)
            for name, p in model.named_parameters()}


def _rowwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, ..., i] times each user's matrix weight [B, i, o] -> [B, ..., o]."""
    shape = x.shape
    return torch.bmm(x.reshape(shape[0], -1, shape[-1]), weight).reshape(*shape[:-1], weight.shape[-1])


def _gat(p: dict[str, torch.Tensor], g: DenseStars, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GATConv(concat=False, add_self_loops=True, negative_slope=0.2) on the user and item nodes."""
    b, d = g.user.shape
    w = p["encoder.conv.lin.weight"].transpose(1, 2)  # [B, d, H*d]
    att_src, att_dst = p["encoder.conv.att_src"], p["encoder.conv.att_dst"]  # [B, 1, H, d]
    z_user = _rowwise(g.user, w).view(b, heads, d)
    z_items = _rowwise(g.items, w).view(b, -1, heads, d)
    z_neigh = _rowwise(g.neighbours, w).view(b, -1, heads, d)
    src_user = (z_user * att_src[:, 0]).sum(-1)  # [B, H]
    dst_user = (z_user * att_dst[:, 0]).sum(-1)
    src_items, dst_items = (z_items * att_src).sum(-1), (z_items * att_dst).sum(-1)  # [B, T, H]
    src_neigh = (z_neigh * att_src).sum(-1)
    # the user node: softmax over itself, its items and its neighbours (padding masked out)
    logits = F.leaky_relu(torch.cat([src_user[:, None], src_items, src_neigh], 1) + dst_user[:, None], 0.2)
    mask = torch.cat([g.item_mask.new_ones(b, 1), g.item_mask, g.neighbour_mask], 1)[..., None]
    alpha = torch.softmax(logits.masked_fill(mask == 0, float("-inf")), 1)  # [B, 1 + T + N, H]
    z_all = torch.cat([z_user[:, None], z_items, z_neigh], 1)
    out_user = (alpha[..., None] * z_all).sum(1).mean(1)  # [B, d]
    # an item node: softmax over itself and its user
    pair = F.leaky_relu(torch.stack([src_items, src_user[:, None].expand_as(src_items)], -1) + dst_items[..., None],
                        0.2)
    beta = torch.softmax(pair, -1)  # [B, T, H, 2]
    out_items = (beta[..., 0:1] * z_items + beta[..., 1:2] * z_user[:, None]).mean(2)  # [B, T, d]
    bias = p["encoder.conv.bias"]
    return out_user + bias, out_items + bias[:, None]


def _gcn(p: dict[str, torch.Tensor], g: DenseStars) -> tuple[torch.Tensor, torch.Tensor]:
    """GCNConv(add_self_loops=True): symmetric in-degree normalisation, self loops of weight 1."""
    w = p["encoder.conv.lin.weight"].transpose(1, 2)
    z_user, z_items, z_neigh = _rowwise(g.user, w), _rowwise(g.items, w), _rowwise(g.neighbours, w)
    deg_user = 1.0 + g.item_mask.sum(1) + g.neighbour_mask.sum(1)  # [B]; an item's in-degree is 2, a neighbour's 1
    inv = deg_user.rsqrt()[:, None]
    out_user = (z_user / deg_user[:, None] + inv * (g.item_mask[..., None] * z_items).sum(1) / 2**0.5
                + inv * (g.neighbour_mask[..., None] * z_neigh).sum(1))
    out_items = z_items / 2.0 + (inv / 2**0.5 * z_user)[:, None]
    bias = p["encoder.conv.bias"]
    return out_user + bias, out_items + bias[:, None]


def _gru(p: dict[str, torch.Tensor], m: torch.Tensor, h: torch.Tensor, with_gate: bool = False):
    """torch.nn.GRUCell(m, h) with each user's weights; h [B, ..., d], and m either like h or [B, d]: one
    message for every row of a user (an item node's message is its user's), transformed once, not per row.
    With `with_gate`, also the update gate z (1: keep h, ignore the message)."""
    gi = _rowwise(m, p["encoder.conv.rnn.weight_ih"].transpose(1, 2))
    gh = _rowwise(h, p["encoder.conv.rnn.weight_hh"].transpose(1, 2))
    shape = [gh.shape[0]] + [1] * (gh.dim() - 2) + [gh.shape[-1]]
    gi = gi.view(*gi.shape[:1], *([1] * (gh.dim() - gi.dim())),
                 *gi.shape[1:]) + p["encoder.conv.rnn.bias_ih"].view(shape)
    gh = gh + p["encoder.conv.rnn.bias_hh"].view(shape)
    i_r, i_z, i_n = gi.chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    out = (1.0 - z) * n + z * h
    return (out, z) if with_gate else out


def _ggnn(p: dict[str, torch.Tensor], g: DenseStars) -> tuple[torch.Tensor, torch.Tensor]:
    """GatedGraphConv(num_layers=1): summed messages x_j W, then a GRU update (no self loops)."""
    w = p["encoder.conv.weight"][:, 0]  # [B, d, d]
    m_user = _rowwise((g.item_mask[..., None] * g.items).sum(1) + (g.neighbour_mask[..., None] * g.neighbours).sum(1),
                      w)
    m_items = _rowwise(g.user, w)  # [B, d]: every item's message is its user's row times W
    return _gru(p, m_user, g.user), _gru(p, m_items, g.items)


def ggnn_user_update(params: dict[str, torch.Tensor], g: DenseStars) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GGNN user node's update, opened up to see how it uses its neighbours: its new representation [B, d],
    its GRU update gate z [B, d] (near 1: it keeps its own embedding and ignores its messages), and the part
    of its message that comes from its neighbours [B, d] (the whole message is the items' part plus this)."""
    w = params["encoder.conv.weight"][:, 0]
    from_neighbours = _rowwise((g.neighbour_mask[..., None] * g.neighbours).sum(1), w)
    m_user = _rowwise((g.item_mask[..., None] * g.items).sum(1), w) + from_neighbours
    out, z = _gru(params, m_user, g.user, with_gate=True)
    return out, z, from_neighbours


def dense_encode(kind: str, heads: int, params: dict[str, torch.Tensor],
                 g: DenseStars) -> tuple[torch.Tensor, torch.Tensor]:
    """Node representations of the user nodes [B, d] and item nodes [B, T, d], as StarGraphEncoder gives them
    (after its dropout, which the caller applies to `g`)."""
    if kind == "gat":
        out_user, out_items = _gat(params, g, heads)
        return g.user + out_user, g.items + out_items
    if kind == "gcn":
        out_user, out_items = _gcn(params, g)
        return g.user + out_user, g.items + out_items
    if kind == "ggnn":
        return _ggnn(params, g)
    raise ValueError(f"model.gnn = {kind!r}; expected gat, gcn or ggnn")


def dense_predict(model: RatingGNN, params: dict[str, torch.Tensor], raw: DenseStars, dropped: DenseStars,
                  item_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Predicted ratings [B, T] of every item slot, as RatingGNN.forward gives them: the encoder reads the
    dropped-out inputs `dropped`, the optional bias vectors the raw inputs `raw`. `item_bias` [B, T]: the
    rows' last column b_i (model.item_bias; the caller splits it off, `raw.items` holds the embeddings)."""
    h_user, h_items = dense_encode(model.encoder.kind, model.encoder.conv.heads if model.encoder.kind == "gat" else 1,
                                   params, dropped)
    pred = (h_items * h_user[:, None]).sum(-1) + params["bias"][:, None]
    if "user_bias_map" in params:
        b_user = (raw.user * params["user_bias_map"]).sum(-1)
        b_items = (raw.items * params["item_bias_map"][:, None]).sum(-1)
        pred = pred + b_user[:, None] + b_items
    if item_bias is not None:
        pred = pred + item_bias
    return pred


def population_predict(model: RatingGNN, items: torch.Tensor, item_bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the model predicts for items [T, dim] when nothing is known of the user: a global bias plus the items'
    own terms t_i (w.x_i with model.biases, b_i with model.item_bias), without the dot product and the user's bias.

    The global bias is b_pop (model.population_bias), trained for this prediction alone, else the full model's b,
    which the users' free terms leave wherever the run started it. A cold user (no training rating) has only its
    embedding as drawn, whose dot products are noise no training corrected: this is all it can be given."""
    first = model.population_bias if model.population_bias is not None else model.bias
    bias_map = None if model.item_bias_map is None else model.item_bias_map.detach()
    return first.detach() + item_own_terms(items, bias_map, item_bias)


def item_own_terms(items: torch.Tensor, bias_map: torch.Tensor | None, item_bias: torch.Tensor | None) -> torch.Tensor:
    """t_i = w.x_i + b_i of item inputs [..., T, dim] (either term absent: 0), `bias_map` w [..., dim] per batch:
    the part of a prediction that belongs to the item alone, shared by the population part and b_pop's gradient."""
    terms = torch.zeros(items.shape[:-1], dtype=items.dtype, device=items.device)
    if bias_map is not None:
        terms = terms + (items * bias_map.unsqueeze(-2)).sum(-1)
    if item_bias is not None:
        terms = terms + item_bias
    return terms
