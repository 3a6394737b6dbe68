"""FPPDM's domain model: LightGCN propagation producing a diagonal Gaussian per user and item.

    E^{(l+1)} = D^{-1/2} A D^{-1/2} E^{(l)},   E = mean_l E^{(l)}       (LightGCN, no weights)
    mu = clamp(E_mu, -R, R),   sigma = min(ELU(E_sigma) + 1, S) > 0       (std of each dimension)
(R and S, the value bounds, hold every upload and barycenter inside what the server accepts by construction;
honest values stay far inside them, where the clamp is the identity)

and the 2-Wasserstein distance between diagonal Gaussians,

    W2^2(N(mu1, s1^2), N(mu2, s2^2)) = ||mu1 - mu2||^2 + ||s1 - s2||^2.

A training step's loss reads only its batch's rows of E. `forward_rows` computes just those rows and the
layer rows they depend on (`RowPlan`), with the exact gradient, through scipy's CSR kernels; `forward()`
computes every row (the reference, and what evaluation and uploads use). On Amazon Electronics a batch's
740 nodes depend on about 30% of the nodes at the second layer and on nearly all at the first, so a
step still costs about 1.7 whole-graph products forward and as many backward, per table (mu, sigma).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn


def normalised_adjacency(num_users: int, num_items: int, users: np.ndarray, items: np.ndarray) -> torch.Tensor:
    """Sparse D^{-1/2} A D^{-1/2} of the bipartite user-item graph (users first, then items)."""
    n = num_users + num_items
    src = np.concatenate([users, num_users + items])
    dst = np.concatenate([num_users + items, users])
    deg = np.bincount(src, minlength=n).astype(np.float32)
    inv = np.where(deg > 0, deg ** -0.5, 0.0).astype(np.float32)
    values = torch.from_numpy(inv[src] * inv[dst])
    index = torch.from_numpy(np.stack([src, dst]).astype(np.int64))
    # CSR: about 1.3x faster than COO for the propagation and its backward pass
    return torch.sparse_coo_tensor(index, values, (n, n)).coalesce().to_sparse_csr()


def w2_squared(mu1: torch.Tensor, s1: torch.Tensor, mu2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Squared 2-Wasserstein distance between diagonal Gaussians (row-wise)."""
    return ((mu1 - mu2) ** 2).sum(-1) + ((s1 - s2) ** 2).sum(-1)


class RowPlan:
    """The rows of every propagation layer that one batch's output rows depend on, and the sparse blocks between them.

    Layer l's output is needed only on T_l: T_L = rows, T_{l-1} = rows | N(T_l); block l is A[T_l, T_{l-1}]
    (columns renumbered within T_{l-1}). A set covering more than `full_fraction` of the nodes is widened
    to all of them (slicing would then cost more than it saves).
    """

    def __init__(self, adj: sp.csr_matrix, layers: int, rows: np.ndarray, full_fraction: float = 0.7):
        n = adj.shape[0]
        self.n, self.rows, self.layers = n, rows, layers
        sets: list[np.ndarray | None] = [None] * (layers + 1)  # None: all n nodes
        blocks: list[sp.csr_matrix] = [adj] * (layers + 1)
        sets[layers] = rows
        for k in range(layers, 0, -1):
            if sets[k] is None:
                break  # all rows from here down: blocks stay the whole matrix
            sub = adj[sets[k]]
            prev = None
            if k > 1:  # rows | N(T_k), sorted (a mask: cheaper than sorting the block's column indices)
                mask = np.zeros(n, bool)
                mask[sub.indices] = True
                mask[rows] = True
                prev = np.flatnonzero(mask)
                if prev.size > full_fraction * n:
                    prev = None
            if prev is not None:
                sub = sp.csr_matrix((sub.data, np.searchsorted(prev, sub.indices), sub.indptr),
                                    shape=(sets[k].size, prev.size))
            blocks[k], sets[k - 1] = sub, prev
        self.blocks = blocks
        # the backward pass's blocks, transposed once for both tables: a CSR product is faster than scipy's
        # CSC one; the whole matrix is symmetric and is its own transpose
        self.blocks_t = [b if b is adj else b.T.tocsr() for b in blocks]
        # where `rows` sit within each layer's set (layer 0: the whole embedding table)
        self.pos = [rows if t is None else np.searchsorted(t, rows) for t in sets]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """(P x)[rows] = mean over l = 0..L of (A^l x)[rows], summed in the order the full propagation sums."""
        out, h = x[self.rows], x
        for k in range(1, self.layers + 1):
            h = self.blocks[k] @ h
            out = out + h[self.pos[k]]
        return out / (self.layers + 1)

    def backward(self, grad_rows: np.ndarray) -> np.ndarray:
        """d loss / d x [n, w] from d loss / d (P x)[rows], layer by layer back down the same blocks."""
        c = grad_rows / (self.layers + 1)
        g = c
        for k in range(self.layers, 0, -1):
            g = self.blocks_t[k] @ g
            g[self.pos[k - 1]] += c  # positions of distinct rows are distinct
        if self.layers == 0:
            g = np.zeros((self.n, c.shape[1]), c.dtype)
            g[self.rows] = c
        return g


class _RowPropagation(torch.autograd.Function):
    """Autograd wrapper of `RowPlan` for several tables at once (mu and sigma): forward and backward through
    scipy's CSR kernels on CPU, one table per thread when torch may use more than one (they release the GIL)."""

    @staticmethod
    def forward(ctx, plan: RowPlan, *tables: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        ctx.plan = plan
        outs = _map(plan.forward, [t.detach().numpy() for t in tables])
        return tuple(torch.from_numpy(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: D102
        outs = _map(ctx.plan.backward, [g.contiguous().numpy() for g in grads])
        return (None, *(torch.from_numpy(o) for o in outs))


_POOL: ThreadPoolExecutor | None = None


def _map(fn, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """fn over arrays, concurrently on up to torch.get_num_threads() threads."""
    global _POOL
    if len(arrays) < 2 or torch.get_num_threads() < 2:
        return [fn(a) for a in arrays]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fppdm-propagation")
    return list(_POOL.map(fn, arrays))


class GaussianLightGCN(nn.Module):
    """Per-domain model: mean and std embeddings for every user and item, smoothed over the graph."""

    def __init__(self, num_users: int, num_items: int, dim: int, layers: int, adjacency: torch.Tensor,
                 gaussian: bool = True, value_bound: tuple[float, float] = (math.inf, math.inf)):
        super().__init__()
        self.num_users, self.num_items, self.layers, self.gaussian = num_users, num_items, layers, gaussian
        self.mu_bound, self.sigma_bound = value_bound  # R, S: |mu| <= R and sigma <= S for every output row
        self.mu = nn.Parameter(torch.randn(num_users + num_items, dim) * 0.1)
        self.sigma_raw = nn.Parameter(torch.randn(num_users + num_items, dim) * 0.1)
        self.register_buffer("adj", adjacency)
        self._adj_scipy: sp.csr_matrix | None = None

    def reset_parameters(self) -> None:
        """Re-draw the embeddings."""
        nn.init.normal_(self.mu, std=0.1)
        nn.init.normal_(self.sigma_raw, std=0.1)

    def _propagate(self, x: torch.Tensor) -> torch.Tensor:
        out, h = x, x
        for _ in range(self.layers):
            h = self.adj @ h
            out = out + h
        return out / (self.layers + 1)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, sigma) [num_users + num_items, dim] after propagation; sigma > 0 (0 for point embeddings)."""
        mu = self._bounded_mu(self._propagate(self.mu))
        if not self.gaussian:
            return mu, torch.zeros_like(mu)
        return mu, self._bounded_sigma(self._propagate(self.sigma_raw))

    def _bounded_mu(self, propagated: torch.Tensor) -> torch.Tensor:
        return propagated if math.isinf(self.mu_bound) else propagated.clamp(-self.mu_bound, self.mu_bound)

    def _bounded_sigma(self, propagated: torch.Tensor) -> torch.Tensor:
        sigma = nn.functional.elu(propagated) + 1.0
        return sigma if math.isinf(self.sigma_bound) else sigma.clamp(max=self.sigma_bound)

    def rows_supported(self) -> bool:
        """True when `forward_rows` can run here (CPU tensors; elsewhere use `forward()` and index)."""
        return self.mu.device.type == "cpu"

    def plan_rows(self, rows: np.ndarray) -> RowPlan:
        """The propagation plan of sorted distinct node ids `rows` (users first, then items)."""
        if self._adj_scipy is None:  # scipy's CSR kernels: about 4x faster than torch's CSR matmul on CPU
            a = self.adj
            self._adj_scipy = sp.csr_matrix((a.values().numpy(), a.col_indices().numpy(), a.crow_indices().numpy()),
                                            shape=tuple(a.shape))
        return RowPlan(self._adj_scipy, self.layers, rows)

    def forward_rows(self, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward()` restricted to the rows of `plan`: the same values and gradients, computing only the
        propagation rows they depend on (one training step needs a few hundred of the graph's nodes)."""
        if not self.gaussian:
            (mu,) = _RowPropagation.apply(plan, self.mu)
            return self._bounded_mu(mu), torch.zeros_like(mu)
        mu, sigma = _RowPropagation.apply(plan, self.mu, self.sigma_raw)
        return self._bounded_mu(mu), self._bounded_sigma(sigma)
