"""A FedGNN user's local step and its protection, as one batched tensor program over the users of a node.

This is the only implementation: a deployed device runs it on a batch of one, a simulated SuperNode on
groups of up to `simulation.user_batch` of its users (`train_users`). The GNN's forward and backward run
on dense padded star graphs with a copy of the weights per user (`fedrec_flwr.models.dense_star`), so
each user gets its own gradient; then each user's upload is protected where it was computed (CPU or
CUDA): pseudo rows fitted to its real rows, clipping, Laplace noise (`fedrec_flwr.privacy`).

Every user draws from its own stream (seed, user, 1, round): first the seed of its dropout masks, then its
mini-batch picks, its pseudo rows and its noise, so a user's numbers do not depend on who shares its batch
(up to float rounding of the batched sums). Users are sorted by how many items they rated and cut into
groups whose padding stays within a quarter of their real size, unless the group is small anyway
(`size_groups`). tests/oracle_local_step.py keeps the PyG formulation as a test oracle.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from fedrec_flwr.data import UserData
from fedrec_flwr.fedgnn.protocol import RoundConfig
from fedrec_flwr.fedgnn.state import UserState
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, ready, row_positions, set_weights
from fedrec_flwr.models.dense_star import DenseStars, dense_predict, item_own_terms, per_user_copies
from fedrec_flwr.models.rating_gnn import RatingGNN, row_width
from fedrec_flwr.privacy import pseudo_gradient_rows
from fedrec_flwr.privacy.ldp import privatize_flat
from fedrec_flwr.privacy_modes import privacy_mode


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
                   neighbour_width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor] | None:
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


class MapTerms(NamedTuple):
    """What the pseudo terms of the item-bias map's gradient need (`protect`), for one user (numpy) or a batch
    (tensors).

    The gradient of a map w that reads item inputs (w.x_j) is the sum over the rated items of c_j x_j, and the server
    knows every x_j it sent: |<gradient, x_j>| and its product with the uploaded row's part along w point at the rated
    items (`audit.attacks.model_gradient_auc`). So each pseudo item adds c'_j x_j too, c'_j drawn with its pseudo row
    from one Gaussian fitted to the rated items' (row, c_j) pairs: the pseudo items then match the rated ones in the
    map's gradient as their rows do in the row part."""

    at: int  # where the map sits among the model weights (in `protect`'s flat upload: its first coordinate)
    coefs: np.ndarray | torch.Tensor  # [(B,) T]: c_j of each rated item (slots past a user's count: padding)
    inputs: list[np.ndarray] | list[torch.Tensor] | np.ndarray  # (per user) [set size, dim]: x_j of the anonymity set


class LocalStep(NamedTuple):
    """One user's local computation: the upload's raw parts and the device's new private state (numpy)."""

    model_grads: list[np.ndarray]
    real_rows: np.ndarray  # gradient rows of the rated items, ascending id
    embedding: np.ndarray  # the updated private user embedding
    loss: float
    offset: float  # the updated private rating offset (model.user_offset; unchanged otherwise)
    maps: MapTerms | None = None  # the item maps' slopes and the set's inputs, where pseudo terms need them


class StepBatch(NamedTuple):
    """The local steps of B users, still as tensors on the device: what `protect` turns into uploads."""

    model_grads: list[torch.Tensor]  # [B, *shape] per model parameter, in model.parameters() order
    rows: torch.Tensor  # [B, T, row width]: user k's real-row gradients in its first counts[k] slots
    counts: list[int]
    embeddings: np.ndarray  # [B, d]
    losses: np.ndarray  # [B]
    offsets: np.ndarray  # [B]
    maps: MapTerms | None = None  # the item maps' slopes and each set's inputs (anonymity sets with item maps only)

    def user(self, k: int) -> LocalStep:
        """User k's step as numpy arrays."""
        maps = None if self.maps is None else MapTerms(
            self.maps.at, self.maps.coefs[k, : self.counts[k]].detach().cpu().numpy(),
            self.maps.inputs[k].detach().cpu().numpy())
        return LocalStep([g[k].detach().cpu().numpy() for g in self.model_grads],
                         self.rows[k, : self.counts[k]].detach().cpu().numpy(), self.embeddings[k],
                         float(self.losses[k]), float(self.offsets[k]), maps)


def idle_steps(model: RatingGNN, states: list[UserState], width: int, device: torch.device) -> StepBatch:
    """The step of users without training ratings: nothing to learn from, so zero gradients (which the
    protection then noises like any upload) and an unchanged private state."""
    b = len(states)
    return StepBatch([torch.zeros((b, *p.shape), device=device) for p in model.parameters()],
                     torch.zeros((b, 0, width), device=device), [0] * b,
                     np.stack([st.embedding for st in states]),
                     np.zeros(b), np.array([st.offset for st in states], np.float64))


class StepGrads(NamedTuple):
    """One mini-batch's gradients of the users' summed weighted losses, by what each is for."""

    model: list[torch.Tensor]  # [B, *shape] per model parameter (each user's own copy), in model.parameters() order
    rows: torch.Tensor  # [B, T, row width]: the rows of each user's rated items
    user: torch.Tensor  # [B, d]: the private user embeddings
    offset: torch.Tensor | None  # [B]: the private rating offsets (model.user_offset), else None


class StepRule(NamedTuple):
    """The switches of a local step, resolved once from the device's config (`of`)."""

    steps: int  # local.steps mini-batches a round
    batch_size: int
    user_steps: int  # local.user_steps: extra private steps of the embedding (and offset) on all the ratings
    user_lr: float
    lr: float  # local.lr: the local copies' SGD rate, with delta uploads
    clip: float  # privacy.clip_delta: each delta step's per-coordinate bound
    sum_loss: bool  # local.loss = "sum": the uploaded rows are the gradient times the pick's size
    sum_model: bool  # ... and so are the model weights' gradients (only a mode whose uploads the server never sees)
    delta: bool  # local.upload = "delta": local copies train, and the upload is their whole change over lr
    private_offset: bool  # model.user_offset: the offset trains with the embedding
    offset_reg: float  # model.user_offset_reg: k, the offset's shrinkage in pseudo-ratings
    population_bias: bool  # model.population_bias: b_pop, the population part's own global bias, trains
    population_item_weight: float  # model.population_item_weight: the population loss's weight on the items' terms

    @classmethod
    def of(cls, cfg: DeviceSections) -> StepRule:
        """The rule of a device's `local`, `privacy` and `model` sections."""
        local = cfg.local
        sum_loss = local.loss == "sum"
        sum_model = sum_loss and privacy_mode(cfg.privacy.mode).part("Device").sums_model_loss
        return cls(local.steps, local.batch_size, local.user_steps, local.user_lr, local.lr, cfg.privacy.clip_delta,
                   sum_loss, sum_model, local.upload == "delta", cfg.model.user_offset, cfg.model.user_offset_reg,
                   cfg.model.population_bias, cfg.model.population_item_weight)

    def uploaded(self, grads: StepGrads, scale: torch.Tensor | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(model part, row part) of the step that enters the upload: the gradient, times each user's pick size
        `scale` with a summed loss (the model part too only where `sum_model`), clipped per coordinate with delta
        uploads (as the server would apply it).

        Under the paper's LDP the model weights keep the mean loss's gradient: the summed loss's is n times larger,
        saturates the per-coordinate clip and keeps its structure, the rated rows' errors times their embeddings,
        which the server matches against the rows it sent (audit AUC 0.81 on fedgnn_tuned's model, 0.48 with the mean
        loss's). The rows, which pseudo rows imitate, keep the summed loss's scale that the tuned presets train on."""
        parts = [*grads.model, grads.rows]
        if scale is not None:
            scaled = parts if self.sum_model else parts[-1:]
            parts = parts[: len(parts) - len(scaled)] + [scale.view(-1, *([1] * (g.dim() - 1))) * g for g in scaled]
        if self.delta:
            parts = [torch.clamp(g, -self.clip, self.clip) for g in parts]
        return parts[:-1], parts[-1]


class StarBatch:
    """The padded star graphs of B users with rated items, as tensors on the device: their item rows (trainable),
    neighbours, embeddings (trainable), offsets, targets, public item features, and a copy of the model's
    weights per user. `predict` is r_hat on every row, with each user's own dropout."""

    def __init__(self, cfg: DeviceSections, model: RatingGNN, states: list[UserState], datas: list[UserData],
                 rows: list[np.ndarray], generators: list[torch.Generator], device: torch.device):
        d = self.dim = cfg.model.dim
        self.item_bias = cfg.model.item_bias  # item rows carry b_i as a last column (width row_width = d + 1)
        self.model, self.dropout, self.generators, self.device = model, cfg.model.dropout, generators, device
        self.counts = [(data.train_items.size, st.neighbours.shape[0]) for st, data in zip(states, datas)]
        self.sizes = np.array([t for t, _ in self.counts])
        self.width, self.neighbour_width = max(t for t, _ in self.counts), max(n for _, n in self.counts)
        whole_table = privacy_mode(cfg.privacy.mode).part("Device").whole_table  # rows of the whole table, not a set
        items = [r[row_positions(st, data.train_items, whole_table)] for st, data, r in zip(states, datas, rows)]
        self.items, self.item_mask = _pad(items, self.width, row_width(cfg.model), device)
        self.items.requires_grad_(True)
        self.neighbours, self.neighbour_mask = _pad([st.neighbours for st in states], self.neighbour_width, d, device)
        self.user = torch.tensor(np.stack([st.embedding for st in states]), device=device, requires_grad=True)
        targets, _ = _pad([data.train_values[:, None] for data in datas], self.width, 1, device)
        self.targets = targets[..., 0]
        self.features = None
        if model.item_feature_map is not None:
            if any(data.item_features is None for data in datas):
                raise ValueError("this model takes public item features (data.item_features), but none were given")
            self.features, _ = _pad([data.item_features[data.train_items] for data in datas], self.width,
                                    datas[0].item_features.shape[1], device)
        self.private_offset = cfg.model.user_offset
        self.offset = torch.tensor([float(st.offset) for st in states], device=device,
                                   requires_grad=self.private_offset)
        self.params = per_user_copies(model, len(states))
        self.leaves = list(self.params.values())  # in model.parameters() order, as uploads carry them
        # where b_pop (model.population_bias) sits among the model weights, or None
        self.population_at = list(self.params).index("population_bias") if "population_bias" in self.params else None
        # where the item-bias map w (model.biases) sits, where its gradient needs the pseudo items' terms: an upload
        # of the anonymity set's rows, which the server can match it against (`MapTerms`); else None
        self.map_at = (list(self.params).index("item_bias_map") if "item_bias_map" in self.params and not whole_table
                       else None)
        self.item_input = (self._rows_as_given if self.features is None
                           else self._features_into_embedding if self.item_bias else self._features_added)

    def _rows_as_given(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _features_added(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.bmm(self.features, self.params["item_feature_map"])

    def _features_into_embedding(self, x: torch.Tensor) -> torch.Tensor:  # the bias column passes through
        d = self.dim
        return torch.cat([x[..., :d] + torch.bmm(self.features, self.params["item_feature_map"]), x[..., d:]], -1)

    def predict(self, x_items: torch.Tensor) -> torch.Tensor:
        """r_hat of every (user, row) for item inputs `x_items` [B, T, row width], dropout drawn per user."""
        d = self.dim
        x_items, b_items = (x_items[..., :d], x_items[..., d]) if self.item_bias else (x_items, None)
        raw = DenseStars(self.user, x_items, self.neighbours, self.item_mask, self.neighbour_mask)
        masks = _dropout_masks(self.generators, self.counts, self.dropout, d, self.width, self.neighbour_width,
                               self.device)
        return dense_predict(self.model, self.params, raw, _dropped(raw, masks), b_items) + self.offset[:, None]

    def errors(self, detach_items: bool = False) -> torch.Tensor:
        """r_hat - r on every padded row, [B, T]."""
        x = self.item_input(self.items)
        return self.predict(x.detach() if detach_items else x) - self.targets

    def squared_errors(self, detach_items: bool = False) -> torch.Tensor:
        """(r_hat - r)^2 on every padded row, [B, T]."""
        return self.errors(detach_items) ** 2

    def set_inputs(self, rows: list[np.ndarray], states: list[UserState], datas: list[UserData]) -> list[torch.Tensor]:
        """Each user's item inputs x_j [set size, dim] of its whole anonymity set (`rows`, as sent, in the order of
        its ids), as its item maps read them: the embedding part, plus the mapped public features."""
        d = self.dim
        out = []
        for k, (r, st, data) in enumerate(zip(rows, states, datas)):
            x = torch.from_numpy(np.asarray(r[:, :d], np.float32)).to(self.device)
            if self.features is not None:
                f = torch.from_numpy(np.asarray(data.item_features[st.anonymity_ids], np.float32)).to(self.device)
                x = x + f @ self.params["item_feature_map"][k].detach()
            out.append(x)
        return out

    def population_residuals(self) -> torch.Tensor:
        """[B, T]: b_pop + t_i - r on every padded row, the population part's error (b_pop, model.population_bias, and
        the item's own terms t_i: w.x_i, b_i), what a user of whom nothing is known would be off by. Differentiable in
        t_i (model.population_item_weight trains it), not in b_pop, whose gradient is `population_bias_gradient`."""
        x = self.item_input(self.items)
        d = self.dim
        terms = item_own_terms(x[..., :d], self.params.get("item_bias_map"), x[..., d] if self.item_bias else None)
        return self.params["population_bias"].detach()[:, None] + terms - self.targets

    def gradients(self, loss: torch.Tensor) -> StepGrads:
        """The gradients of `loss` with respect to each user's weights, rows, embedding and (private) offset.
        b_pop (model.population_bias) is not in the full prediction: its slot holds zeros here, and its own
        gradient (`population_bias_gradient`) replaces them."""
        offset = [self.offset] if self.private_offset else []
        used = [leaf for name, leaf in self.params.items() if name != "population_bias"]
        grads = list(torch.autograd.grad(loss, [*used, self.items, self.user, *offset]))
        n = len(used)
        model = grads[:n]
        if self.population_at is not None:
            model.insert(self.population_at, torch.zeros_like(self.params["population_bias"]))
        return StepGrads(model, grads[n], grads[n + 1], grads[n + 2] if offset else None)

    def private_gradients(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradients of `loss` with respect to the private embeddings and (private) offsets only."""
        offset = [self.offset] if self.private_offset else []
        grads = torch.autograd.grad(loss, [self.user, *offset])
        return grads[0], grads[1] if offset else None

    def minibatch_weights(self, rngs: list[np.random.Generator], batch_size: int) -> torch.Tensor:
        """[B, T] weights 1 / |pick| on each user's pick of up to batch_size of its ratings (from its own stream)."""
        weight = np.zeros((len(rngs), self.width), np.float32)
        for k, (rng, t) in enumerate(zip(rngs, self.sizes)):
            pick = rng.permutation(t)[:batch_size]
            weight[k, pick] = 1.0 / pick.size
        return torch.from_numpy(weight).to(self.device)


def population_bias_gradient(weights: torch.Tensor, residuals: torch.Tensor) -> torch.Tensor:
    """[B]: each user's gradient, for its weights `weights` [B, T] on its rows (1 / |pick| each), of the population
    loss sum w (b_pop + t_i - r)^2 with respect to b_pop, from its `residuals` b_pop + t_i - r
    (`StarBatch.population_residuals`): b_pop + t_i is then a prediction without the user's terms, what a cold user
    is given. A mean over the user's pick, not a sum: a heavy rater's pull does not crowd its update's clip (under
    user-level DP each user's whole update, this pull included, is still scaled by its clip factor)."""
    return 2 * (weights * residuals).sum(1)


def local_steps(cfg: DeviceSections, model: RatingGNN, states: list[UserState], datas: list[UserData],
                rows: list[np.ndarray], rngs: list[np.random.Generator], generators: list[torch.Generator],
                device: torch.device) -> StepBatch:
    """The paper's LocalGradCal (or local training, with local.upload = "delta") for B users with rated items,
    all with the same config and model, as one batched computation.

    Gradients are averaged over `local.steps` mini-batches; each user's embedding takes a plain SGD step
    after each one, then `user_steps - 1` more on all its ratings, and stays on the device. With "delta"
    uploads each step also moves a local copy of the model and of the rated items' rows by SGD at `local.lr`
    on the (`local.loss`-scaled) gradient clipped to the upload's clip bound, so later steps see the user's
    own progress and no local path can run away; what is returned is the whole local change over lr (the
    sum of the clipped steps), which the protection then clips and noises once. One step of either kind
    gives the same upload once clipped.
    """
    rule = StepRule.of(cfg)
    x = StarBatch(cfg, ready(model, device, training=True), states, datas, rows, generators, device)
    # uploads carry the gradient of the summed loss with local.loss = "sum": each user's scale is its pick's size
    scale = (torch.from_numpy(np.minimum(x.sizes, rule.batch_size).astype(np.float32)).to(device)
             if rule.sum_loss else None)
    model_sum = [torch.zeros_like(p) for p in x.leaves]
    row_sum = torch.zeros_like(x.items)
    loss_sum = torch.zeros(len(states), dtype=torch.float64, device=device)
    # the offset's shrinkage: k / n * offset^2 beside each user's mean loss (its gradient, added to the loss's)
    shrink = torch.from_numpy(2 * rule.offset_reg / x.sizes).to(device=device, dtype=x.offset.dtype)
    # the item-bias map's slopes c_j (`MapTerms`)
    coef_sum = None if x.map_at is None else torch.zeros(x.items.shape[:2], device=device)
    set_inputs = None if coef_sum is None else x.set_inputs(rows, states, datas)  # as the server sent them
    for _ in range(rule.steps):
        weights = x.minibatch_weights(rngs, rule.batch_size)
        errors = x.errors()
        per_user = (weights * errors ** 2).sum(1)
        loss = per_user.sum()
        residuals = x.population_residuals() if rule.population_bias else None
        if coef_sum is not None:  # d loss / d (w.x_j): the full loss's (and the population loss's, user-level DP)
            with torch.no_grad():
                slope = 2 * weights * errors
                if rule.population_item_weight:
                    slope = slope + rule.population_item_weight * 2 * weights * residuals
                coef_sum += slope
        if rule.population_item_weight:  # the items' own terms also learn the population part (the private ones not)
            loss = loss + rule.population_item_weight * (weights * residuals ** 2).sum()
        grads = x.gradients(loss)
        model_step, row_step = rule.uploaded(grads, scale)
        if rule.population_bias:  # b_pop: the user's mean population residual, whatever its count or local.loss
            pop = population_bias_gradient(weights, residuals.detach())
            model_step[x.population_at] = torch.clamp(pop, -rule.clip, rule.clip) if rule.delta else pop
        for acc, g in zip(model_sum, model_step):
            acc += g
        row_sum += row_step
        with torch.no_grad():  # the private embedding (and offset) always follow the mean loss
            x.user -= rule.user_lr * grads.user
            if grads.offset is not None:
                x.offset -= rule.user_lr * (grads.offset + shrink * x.offset)
            if rule.delta:  # train the local copies: the next step starts where this one ends
                for p, g in zip(x.leaves, model_step):
                    p -= rule.lr * g
                x.items -= rule.lr * row_step
        loss_sum += per_user.detach()
    every_rating = x.item_mask / x.item_mask.sum(1, keepdim=True)
    for _ in range(rule.user_steps - 1):  # extra private steps: personalisation costs no privacy
        user_grad, offset_grad = x.private_gradients((every_rating * x.squared_errors(detach_items=True)).sum())
        with torch.no_grad():
            x.user -= rule.user_lr * user_grad
            if offset_grad is not None:
                x.offset -= rule.user_lr * (offset_grad + shrink * x.offset)
    steps = 1 if rule.delta else rule.steps  # delta: the whole local change over lr; gradient: the mean
    with torch.no_grad():
        model_grads = model_sum if steps == 1 else [g / steps for g in model_sum]
        rows_out = row_sum.detach() if steps == 1 else row_sum.detach() / steps
    offsets = (x.offset.detach().cpu().numpy().astype(np.float64) if rule.private_offset
               else np.array([st.offset for st in states]))
    maps = None if coef_sum is None else MapTerms(x.map_at, coef_sum / steps, set_inputs)
    return StepBatch(model_grads, rows_out, [t for t, _ in x.counts], x.user.detach().cpu().numpy(),
                     (loss_sum / rule.steps).cpu().numpy(), offsets, maps)


def protect(cfg: DeviceSections, states: list[UserState], datas: list[UserData], batch: StepBatch,
            rngs: list[np.random.Generator]) -> list[list[np.ndarray]]:
    """Each user's protected upload [*model grads, ids, rows]: its real rows and its pseudo rows merged by
    id (pseudo rows fitted to the real ones, `pseudo_gradient_rows`), then, with LDP on, every coordinate
    clipped to delta plus Laplace(lambda) noise, computed on the batch's device with each user's own stream."""
    p = cfg.privacy
    b = len(states)
    shapes = [tuple(g.shape[1:]) for g in batch.model_grads]
    ends = np.cumsum([int(np.prod(shape)) for shape in shapes]).tolist()
    with torch.no_grad():
        flat_model = torch.cat([g.reshape(b, -1) for g in batch.model_grads],
                               1) if shapes else batch.rows.new_zeros((b, 0))
        size = flat_model.shape[1]
        uploads = []
        starts = [0, *ends[:-1]]
        for k, (st, data, rng) in enumerate(zip(states, datas, rngs)):
            real = batch.rows[k, : batch.counts[k]]
            maps = None if batch.maps is None else MapTerms(
                starts[batch.maps.at], batch.maps.coefs[k, : batch.counts[k]], batch.maps.inputs[k])
            upload = _merged(st, data, rng, flat_model[k], real, maps)
            if not torch.isfinite(upload).all():
                # a step that overflowed, or pseudo rows fitted to a huge one (a download within the bounds can do it to
                # the raters of an item alone), is sent as no step: a non-finite value would pass clip and noise. No
                # step is all zeros (pseudo rows fitted to zero rows are zero), filled in place: a second merge would
                # take a pseudo-row draw longer, and the server could time which users overflowed
                upload.zero_()
            if p.ldp:  # one draw for the whole upload, model gradients first
                privatize_flat(upload, p.clip_delta, p.noise_lambda, rng)
            flat = upload.cpu().numpy()
            parts = [flat[start:end].reshape(shape) for shape, start, end in zip(shapes, [0, *ends[:-1]], ends)]
            uploads.append([*parts, st.anonymity_ids.copy(), flat[size:].reshape(st.anonymity_ids.size, real.shape[1])])
    return uploads


def _merged(st: UserState, data: UserData, rng: np.random.Generator, own_model: torch.Tensor,
            real: torch.Tensor, maps: MapTerms | None = None) -> torch.Tensor:
    """One user's upload before its noise, flat in the wire's order: its model part, then the rows of its anonymity
    set, the real rows where it rated and pseudo rows fitted to them (from its secure stream) elsewhere. With the
    item-bias map (`maps`, its flat offset in `at`), each pseudo row is drawn with a slope c'_j, from one Gaussian
    fitted to the rated items' rows and slopes, and the map's gradient gains c'_j x_j (`MapTerms`)."""
    size = own_model.numel()
    width = real.shape[1]
    upload = own_model.new_empty(size + st.anonymity_ids.size * width)
    upload[:size] = own_model
    rows = upload[size:].view(st.anonymity_ids.size, width)
    is_pseudo = np.ones(st.anonymity_ids.size, bool)
    real_at = np.searchsorted(st.anonymity_ids, data.train_items)
    is_pseudo[real_at] = False
    pseudo_at = torch.from_numpy(np.flatnonzero(is_pseudo)).to(rows.device)
    rows[torch.from_numpy(real_at).to(rows.device)] = real  # both in ascending item-id order
    count = st.anonymity_ids.size - real_at.size
    if maps is None:
        rows[pseudo_at] = pseudo_gradient_rows(rng, real, count)  # from the user's secure stream, as the noise
        return upload
    # the slopes at the rows' spread, so that the fit's shrinkage towards one variance treats both alike
    coefs = maps.coefs.to(real.dtype)
    spread = coefs.std() if coefs.numel() > 1 else coefs.abs().amax()
    unit = real.std() / spread if real.numel() > 1 and spread > 0 else torch.ones_like(spread)
    drawn = pseudo_gradient_rows(rng, torch.cat([real, (coefs * unit)[:, None]], 1), count)
    rows[pseudo_at] = drawn[:, :width]
    inputs = maps.inputs[pseudo_at]
    upload[maps.at : maps.at + inputs.shape[1]] += (drawn[:, width] / unit) @ inputs
    return upload


def _as_batch(step: LocalStep, device: torch.device) -> StepBatch:
    rows = torch.from_numpy(np.asarray(step.real_rows, np.float32)).to(device)[None]
    maps = None if step.maps is None else MapTerms(
        step.maps.at, torch.from_numpy(np.asarray(step.maps.coefs, np.float32)).to(device)[None],
        [torch.from_numpy(np.asarray(step.maps.inputs, np.float32)).to(device)])
    return StepBatch([torch.from_numpy(np.asarray(g, np.float32)).to(device)[None] for g in step.model_grads], rows,
                     [rows.shape[1]], step.embedding[None], np.array([step.loss]), np.array([step.offset]), maps)


def local_gradients(cfg: DeviceSections, model: RatingGNN, state: UserState, data: UserData, item_rows: np.ndarray,
                    rng: np.random.Generator, device: torch.device | None = None,
                    generator: torch.Generator | None = None) -> LocalStep:
    """One user's local step (`local_steps` on a batch of one). `generator` draws its dropout masks (by
    default one seeded from `rng`, as `train_users` does)."""
    device = device or torch.device("cpu")
    if generator is None:  # drawn first, with or without ratings, as `FedGNNUser.begin_train` draws it
        generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
    if data.train_items.size == 0:
        return idle_steps(model, [state], item_rows.shape[1], device).user(0)
    return local_steps(cfg, model, [state], [data], [item_rows], [rng], [generator], device).user(0)


def protected_upload(cfg: DeviceSections, state: UserState, data: UserData, step: LocalStep,
                     rng: np.random.Generator, device: torch.device | None = None) -> list[np.ndarray]:
    """One user's protected upload [*model grads, ids, rows] of a `LocalStep` (`protect` on a batch of one)."""
    return protect(cfg, [state], [data], _as_batch(step, device or torch.device("cpu")), [rng])[0]


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


def run_local_steps(users: list[FedGNNUser], weights: list[np.ndarray], rows: list[np.ndarray], server_round: int,
                    round_config: RoundConfig | None, batch: int,
                    consume: Callable[[list[int], StepBatch, list[np.random.Generator]], None]) -> None:
    """The local steps of `users` for this round, up to `batch` computed together (`size_groups`); each group's
    `StepBatch` goes to `consume(indices into users, steps, the group's streams)`, which protects the uploads (or
    clips them into a node's sum) and keeps the users' new private state. Users without training ratings come
    first, as one group of zero gradients."""
    if not users:
        return
    started = [u.begin_train(server_round, round_config) for u in users]
    rngs = [rng for rng, _ in started]
    generators = [torch.Generator().manual_seed(seed) for _, seed in started]
    device, cfg, model = users[0].device, users[0].cfg, users[0].model
    set_weights(model, weights)
    rows = [u.item_rows(r) for u, r in zip(users, rows)]
    idle = [k for k, u in enumerate(users) if not u.data.train_items.size]
    if idle:
        consume(idle, idle_steps(model, [users[k].state for k in idle], row_width(cfg.model), device),
                [rngs[k] for k in idle])
    active = sorted((k for k, u in enumerate(users) if u.data.train_items.size),
                    key=lambda k: users[k].data.train_items.size)
    for group in size_groups(active, [u.data.train_items.size for u in users], max(batch, 1)):
        steps = local_steps(cfg, model, [users[k].state for k in group], [users[k].data for k in group],
                            [rows[k] for k in group], [rngs[k] for k in group], [generators[k] for k in group], device)
        consume(group, steps, [rngs[k] for k in group])


def train_users(users: list[FedGNNUser], weights: list[np.ndarray], rows: list[np.ndarray], server_round: int,
                round_config: RoundConfig | None = None, batch: int = 32) -> list[list[np.ndarray]]:
    """Each user's protected upload [*grads, ids, rows] for this round, the local steps and protection of up to
    `batch` users computed together (batch 1: one user at a time, the same numbers up to float rounding)."""
    uploads: list[list[np.ndarray] | None] = [None] * len(users)

    def protect_group(group: list[int], steps: StepBatch, rngs: list[np.random.Generator]) -> None:
        cfg = users[group[0]].cfg
        states, datas = [users[k].state for k in group], [users[k].data for k in group]
        for k, up, emb, off in zip(group, protect(cfg, states, datas, steps, rngs), steps.embeddings, steps.offsets):
            users[k].finish_train(emb, float(off), server_round)
            uploads[k] = up

    run_local_steps(users, weights, rows, server_round, round_config, batch, protect_group)
    return uploads
