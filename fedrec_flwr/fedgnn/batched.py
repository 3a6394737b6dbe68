"""The local steps of many users on one node as one batched computation (FedGNN simulation).

`train_users` gives each user exactly what `FedGNNUser.train` gives it alone: the same random
streams (mini-batch picks from the user's numpy stream, dropout masks from a torch generator
seeded from it, then its pseudo rows and LDP noise), the same state updates and the same
protected upload; only the arithmetic is batched (`fedrec_flwr.models.dense_star`), so the
numbers agree with the one-user path up to float rounding. Users are sorted by how many items
they rated and cut into groups of at most `batch` users whose padding stays within a quarter of their
real size, unless the group is small anyway (`size_groups`).

A deployed device hosts one user and never needs this; a simulated SuperNode hosting hundreds
of users spends most of its time here.
"""

from __future__ import annotations

import numpy as np
import torch

from fedrec_flwr.fedgnn.protocol import RoundConfig
from fedrec_flwr.fedgnn.user import FedGNNUser, LocalStep, local_gradients, ready, set_weights
from fedrec_flwr.models.dense_star import DenseStars, dense_predict, per_user_copies
from fedrec_flwr.models.rating_gnn import row_width


def _pad(rows: list[np.ndarray], width: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of each user stacked into [B, width, d] with zeros after each user's own, and the [B, width] mask
    (d: the rows' own width, `row_width` for item rows, the model's dim for neighbour rows)."""
    out = np.zeros((len(rows), width, d), np.float32)
    mask = np.zeros((len(rows), width), np.float32)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
        mask[b, : r.shape[0]] = 1.0
    return torch.from_numpy(out).to(device), torch.from_numpy(mask).to(device)


def _dropout_masks(generators: list[torch.Generator], counts: list[tuple[int, int]], p: float, d: int, width: int,
                   neighbour_width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One forward's dropout masks (already divided by 1 - p) for the user, item and neighbour rows, drawn per
    user from its own generator over its [1 + T + N, d] nodes, as nn.Dropout draws them on the one-user path."""
    if p == 0.0:
        return None
    b = len(generators)
    user = torch.empty(b, d)
    items = torch.zeros(b, width, d)
    neigh = torch.zeros(b, neighbour_width, d)
    for k, (gen, (t, n)) in enumerate(zip(generators, counts)):
        mask = torch.empty(1 + t + n, d).bernoulli_(1.0 - p, generator=gen).div_(1.0 - p)
        user[k], items[k, :t], neigh[k, :n] = mask[0], mask[1 : 1 + t], mask[1 + t :]
    return user.to(device), items.to(device), neigh.to(device)


def _dropped(g: DenseStars, masks) -> DenseStars:
    if masks is None:
        return g
    return g._replace(user=g.user * masks[0], items=g.items * masks[1], neighbours=g.neighbours * masks[2])


def batched_local_gradients(users: list[FedGNNUser], rows: list[np.ndarray], rngs: list[np.random.Generator],
                            generators: list[torch.Generator], device: torch.device) -> list[LocalStep]:
    """`local_gradients` of every user in `users` (all with rated items, same config and model) in one batch."""
    cfg, model = users[0].cfg, users[0].model
    model = ready(model, device, training=True)
    d, b = cfg.model.dim, len(users)
    row_bias = cfg.model.item_bias  # item rows carry b_i as a last column (width row_width = d + 1)
    counts = [(u.data.train_items.size, u.state.neighbours.shape[0]) for u in users]
    width, n_width = max(t for t, _ in counts), max(n for _, n in counts)
    items_np = [r[np.searchsorted(u.state.anonymity_ids, u.data.train_items)] for u, r in zip(users, rows)]
    items_x, item_mask = _pad(items_np, width, row_width(cfg.model), device)
    items_x.requires_grad_(True)
    neigh_x, neigh_mask = _pad([u.state.neighbours for u in users], n_width, d, device)
    user_x = torch.tensor(np.stack([u.state.embedding for u in users]), device=device, requires_grad=True)
    targets, _ = _pad([u.data.train_values[:, None] for u in users], width, 1, device)
    targets = targets[..., 0]
    features = None
    if model.item_feature_map is not None:
        if any(u.data.item_features is None for u in users):
            raise ValueError("this model takes public item features (data.item_features), but none were given")
        features, _ = _pad([u.data.item_features[u.data.train_items] for u in users], width,
                           users[0].data.item_features.shape[1], device)
    private, delta = cfg.model.user_offset, cfg.local.upload == "delta"
    offset = torch.tensor([float(u.state.offset) for u in users], device=device, requires_grad=private)
    params = per_user_copies(model, b)
    leaves = list(params.values())  # in model.parameters() order, as uploads carry them

    def item_input(x: torch.Tensor) -> torch.Tensor:
        if features is None:
            return x
        if row_bias:  # the features map into the embedding part; the bias column passes through
            return torch.cat([x[..., :d] + torch.bmm(features, params["item_feature_map"]), x[..., d:]], -1)
        return x + torch.bmm(features, params["item_feature_map"])

    def predict(x_items: torch.Tensor) -> torch.Tensor:
        x_items, b_items = (x_items[..., :d], x_items[..., d]) if row_bias else (x_items, None)
        raw = DenseStars(user_x, x_items, neigh_x, item_mask, neigh_mask)
        masks = _dropout_masks(generators, counts, cfg.model.dropout, d, width, n_width, device)
        return dense_predict(model, params, raw, _dropped(raw, masks), b_items) + offset[:, None]

    def expand(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return v.view(-1, *([1] * (like.dim() - 1)))

    grad_sum = [torch.zeros_like(p) for p in leaves]
    row_grad = torch.zeros_like(items_x)
    losses = np.zeros((cfg.local.steps, b))
    sizes = np.array([t for t, _ in counts])
    # uploads carry the gradient of the summed loss with local.loss = "sum": each user's scale is its pick's size
    picked = np.minimum(sizes, cfg.local.batch_size).astype(np.float32)
    scale = torch.from_numpy(picked if cfg.local.loss == "sum" else np.ones(b, np.float32)).to(device)
    for s in range(cfg.local.steps):
        weight = np.zeros((b, width), np.float32)
        for k, (rng, t) in enumerate(zip(rngs, sizes)):
            pick = rng.permutation(t)[: cfg.local.batch_size]
            weight[k, pick] = 1.0 / pick.size
        weight_t = torch.from_numpy(weight).to(device)
        err = (predict(item_input(items_x)) - targets) ** 2
        per_user = (weight_t * err).sum(1)
        grads = torch.autograd.grad(per_user.sum(), [*leaves, items_x, user_x, *([offset] if private else [])])
        if private:
            *grads, g_offset = grads
        step = [expand(scale, g) * g for g in grads[: len(leaves) + 1]]
        if delta:
            step = [torch.clamp(g, -cfg.privacy.clip_delta, cfg.privacy.clip_delta) for g in step]
        for acc, g in zip(grad_sum, step[: len(leaves)]):
            acc += g
        row_grad += step[len(leaves)]
        with torch.no_grad():
            user_x -= cfg.local.user_lr * grads[-1]
            if private:
                offset -= cfg.local.user_lr * g_offset
            if delta:
                for p, g in zip(leaves, step[: len(leaves)]):
                    p -= cfg.local.lr * g
                items_x -= cfg.local.lr * step[len(leaves)]
        losses[s] = per_user.detach().cpu().numpy()
    full = (item_mask / item_mask.sum(1, keepdim=True))
    for _ in range(cfg.local.user_steps - 1):
        err = (predict(item_input(items_x).detach()) - targets) ** 2
        g_user, *g_off = torch.autograd.grad((full * err).sum(), [user_x, *([offset] if private else [])])
        with torch.no_grad():
            user_x -= cfg.local.user_lr * g_user
            if private:
                offset -= cfg.local.user_lr * g_off[0]
    steps = 1 if delta else cfg.local.steps
    model_grads = [(g / steps).detach().cpu().numpy() for g in grad_sum]
    rows_out = (row_grad / steps).detach().cpu().numpy()
    emb, off = user_x.detach().cpu().numpy(), offset.detach().cpu().numpy()
    return [LocalStep([g[k] for g in model_grads], rows_out[k, :t], emb[k],
                      float(losses[:, k].mean()), float(off[k]) if private else float(users[k].state.offset))
            for k, (t, _) in enumerate(counts)]


PADDING_SLACK = 1.25  # a group's padded item slots may exceed its real ones by at most this factor ...
SMALL_GROUP_SLOTS = 4096  # ... once it has more slots than this: below it a group's fixed cost dominates


def size_groups(order: list[int], sizes: list[int], batch: int, slack: float = PADDING_SLACK,
                small: int = SMALL_GROUP_SLOTS) -> list[list[int]]:
    """`order` (users by ascending `sizes`, their rated-item counts) cut into groups of at most `batch`
    users whose padded slots (group size x its largest user) stay within `slack` x their real ones,
    or within `small` slots in all.

    A fixed cut of 32 would pad every group to its largest member: on power-law degrees (a median of
    50 ratings, a maximum of 4,000) that is 8 times the real work. Small groups are not cut for
    padding: there the per-group Python and kernel overhead costs more than the padded slots."""
    groups: list[list[int]] = []
    group: list[int] = []
    total = 0
    for k in order:
        t = sizes[k]
        padded = (len(group) + 1) * t
        if group and (len(group) == batch or (padded > slack * (total + t) and padded > small)):
            groups.append(group)
            group, total = [], 0
        group.append(k)
        total += t
    return groups + ([group] if group else [])


def train_users(users: list[FedGNNUser], weights: list[np.ndarray], rows: list[np.ndarray], server_round: int,
                round_config: RoundConfig | None = None, batch: int = 32) -> list[list[np.ndarray]]:
    """Each user's protected upload [*grads, ids, rows] for this round, as `FedGNNUser.train` gives it, with
    the local steps of up to `batch` users computed together (batch <= 1: one user at a time)."""
    if batch <= 1:
        return [u.train(weights, r, server_round, round_config) for u, r in zip(users, rows)]
    started = [u.begin_train(server_round, round_config) for u in users]
    rngs = [rng for rng, _ in started]
    generators = [torch.Generator().manual_seed(seed) for _, seed in started]
    device = users[0].device
    set_weights(users[0].model, weights)
    rows = [u.item_rows(r) for u, r in zip(users, rows)]
    steps: list[LocalStep | None] = [None] * len(users)
    active = [k for k, u in enumerate(users) if u.data.train_items.size]
    for k in (k for k, u in enumerate(users) if not u.data.train_items.size):  # nothing to learn from: zero upload
        steps[k] = local_gradients(users[k].cfg, users[k].model, users[k].state, users[k].data, rows[k], rngs[k], device)
    active.sort(key=lambda k: users[k].data.train_items.size)
    for group in size_groups(active, [u.data.train_items.size for u in users], batch):
        out = batched_local_gradients([users[k] for k in group], [rows[k] for k in group], [rngs[k] for k in group],
                                      [generators[k] for k in group], device)
        for k, step in zip(group, out):
            steps[k] = step
    return [u.finish_train(step, rng, server_round) for u, step, rng in zip(users, steps, rngs)]
