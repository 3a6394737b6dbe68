"""The star-graph GNN layers' weights, held as PyG's GATConv, GCNConv and GatedGraphConv hold theirs,
without importing PyG; and PyG's own layer over them, imported on first use.

Devices and the server only store these weights and run the dense forms in `dense_star`. Importing
torch_geometric costs about 2.8 s of CPU (it imports torch._dynamo), nearly half of what a FedGNN
ClientApp process spent importing before it could handle its message (~6.5 s, now ~3.6 s on the CPU box),
and a deployed SuperNode starts one such process per message. So the federated path never imports it. Names, shapes,
registration order and initial random draws are PyG's (tests/test_models.py builds both from one seed and compares
them), so weights, checkpoints and uploads are those of the PyG layers, and `pyg_layer` runs PyG's message
passing over the very same parameters: the centralized reference and the test oracle use it.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

GNN_TYPES = ("gat", "gcn", "ggnn")


def _glorot(t: torch.Tensor) -> None:
    """torch_geometric.nn.inits.glorot: uniform in +-sqrt(6 / (fan_in + fan_out)) of the last two axes."""
    bound = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        t.uniform_(-bound, bound)


class GlorotLinear(nn.Module):
    """torch_geometric.nn.Linear(i, o, bias=False, weight_initializer="glorot"): a weight [o, i]."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the weight again (glorot)."""
        _glorot(self.weight)


class GATWeights(nn.Module):
    """GATConv(dim, dim, heads, concat=False)'s weights: att_src, att_dst [1, H, d], bias [d], lin.weight [H d, d]."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.lin = GlorotLinear(dim, heads * dim)
        self.att_src = nn.Parameter(torch.empty(1, heads, dim))
        self.att_dst = nn.Parameter(torch.empty(1, heads, dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyG's order: lin (glorot), att_src, att_dst (glorot), bias (zeros)."""
        self.lin.reset_parameters()
        _glorot(self.att_src)
        _glorot(self.att_dst)
        nn.init.zeros_(self.bias)


class GCNWeights(nn.Module):
    """GCNConv(dim, dim)'s weights: bias [d], lin.weight [d, d]."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = GlorotLinear(dim, dim)
        self.bias = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyG's order: lin (glorot), bias (zeros)."""
        self.lin.reset_parameters()
        nn.init.zeros_(self.bias)


class GGNNWeights(nn.Module):
    """GatedGraphConv(dim, num_layers=1)'s weights: weight [1, d, d] and a GRUCell(d, d) `rnn`."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, dim, dim))
        self.rnn = nn.GRUCell(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyG's order: weight uniform in +-1/sqrt(d), then the GRU cell's own reset."""
        bound = 1.0 / math.sqrt(self.weight.shape[-1])
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
        self.rnn.reset_parameters()


def layer_weights(kind: str, dim: int, heads: int = 1) -> nn.Module:
    """The weights of one GNN layer of `kind` (gat, gcn or ggnn) at width `dim`."""
    if kind == "gat":
        return GATWeights(dim, heads)
    if kind == "gcn":
        return GCNWeights(dim)
    if kind == "ggnn":
        return GGNNWeights(dim)
    raise ValueError(f"model.gnn = {kind!r}; expected one of {GNN_TYPES}")


_PYG_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pyg_layer(weights: nn.Module) -> nn.Module:
    """PyG's layer (GATConv, GCNConv, GatedGraphConv) whose parameters are `weights`' own tensors, for its message
    passing over an edge_index. Built once per weights module, without touching the random stream, and re-pointed
    at the current parameters at every call (`.to(device)` may replace them)."""
    layer = _PYG_LAYERS.get(weights)
    if layer is None:
        from torch_geometric.nn import GATConv, GatedGraphConv, GCNConv

        dim = (weights.bias if not isinstance(weights, GGNNWeights) else weights.weight).shape[-1]
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            if isinstance(weights, GATWeights):
                layer = GATConv(dim, dim, heads=weights.heads, concat=False, add_self_loops=True)
            elif isinstance(weights, GCNWeights):
                layer = GCNConv(dim, dim, add_self_loops=True)
            else:
                layer = GatedGraphConv(dim, num_layers=1)
        _PYG_LAYERS[weights] = layer
    for name, p in weights.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(layer.get_submodule(owner) if owner else layer, leaf, p)
    return layer.train(weights.training)
