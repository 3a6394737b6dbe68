"""The PyG formulation of one user's local step and evaluation, kept as a test oracle for
`fedrec_flwr.fedgnn.local_step` and `fedrec_flwr.fedgnn.user.evaluate_user`.

The product computes local steps and evaluations only through the dense path; this is the same computation
written with PyG's layers on one star graph (`RatingGNN.forward`), as the paper states it. Tests compare
the two within float32 rounding (tests/test_batched_users.py). A PyG rename of a layer's parameters, or a
change in its arithmetic, shows up here first.
"""

from __future__ import annotations

import numpy as np
import torch

from fedrec_flwr.data import UserData
from fedrec_flwr.fedgnn.local_step import LocalStep, MapTerms
from fedrec_flwr.fedgnn.state import UserState
from fedrec_flwr.fedgnn.user import DeviceSections, _features_of, ready
from fedrec_flwr.metrics import ErrorSums, squared_error_sum
from fedrec_flwr.models.rating_gnn import RatingGNN
from fedrec_flwr.models.star_graph import build_star_batch


def pyg_local_step(
    cfg: DeviceSections,
    model: RatingGNN,
    state: UserState,
    data: UserData,
    item_rows: np.ndarray,
    rng: np.random.Generator,
    device: torch.device | None = None,
) -> LocalStep:
    """The paper's LocalGradCal on one user with PyG's layers; dropout masks from torch's global generator.

    Returns the model gradients, the gradient rows of the rated items, the updated user embedding,
    the training loss and the updated private offset (a `LocalStep`). Gradients are averaged over `local.steps`
    mini-batches; the user embedding takes a plain SGD step after each one, then `user_steps - 1` more on all the
    user's ratings, and stays on the device. With "delta" uploads each step also moves a local
    copy of the model and of the rated items' rows by SGD at `local.lr` on the (`local.loss`-scaled)
    gradient clipped to the upload's clip bound, so later steps see the user's own progress and no
    local path can run away; what is returned is the whole local change over lr (the sum of the
    clipped steps), which the upload then clips and noises once. One step of either kind gives the
    same upload once clipped.
    """
    device = device or torch.device("cpu")
    model = ready(model, device, training=True)
    if data.train_items.size == 0:  # nothing to learn from: zero gradients, which LDP then noises like any upload
        zeros = [np.zeros(tuple(p.shape), np.float32) for p in model.parameters()]
        return LocalStep(zeros, np.zeros((0, item_rows.shape[1]), np.float32), state.embedding.copy(), 0.0,
                         state.offset)
    pos = np.searchsorted(state.anonymity_ids, data.train_items)
    items_x = torch.tensor(item_rows[pos], device=device, requires_grad=True)
    features = _features_of(data, data.train_items, device)
    user_x = torch.tensor(state.embedding[None, :], device=device, requires_grad=True)
    private = cfg.model.user_offset  # a scalar only this device holds and trains, added to every prediction
    delta = cfg.local.upload == "delta"
    offset = torch.tensor(float(state.offset), device=device, requires_grad=private)
    targets = torch.from_numpy(data.train_values).to(device)
    neigh_x = torch.from_numpy(state.neighbours).to(device)
    batch = build_star_batch([data.train_items.size], None, [state.neighbours.shape[0]]).to(device)
    params = list(model.parameters())
    # the item-bias map's slopes (d loss / d prediction of each rated item) and the set's inputs as sent, for the
    # pseudo items' map terms of an anonymity-set upload
    map_at = next((k for k, p in enumerate(params) if p is model.item_bias_map), None) if (
        cfg.privacy.mode != "user_dp") else None
    slopes = torch.zeros(data.train_items.size, device=device)
    with torch.no_grad():
        set_x = model.item_input(torch.from_numpy(item_rows).to(device),
                                 _features_of(data, state.anonymity_ids, device))[:, : model.dim].clone()
    grad_sum = [torch.zeros_like(p) for p in params]
    row_grad = torch.zeros_like(items_x)
    losses = []
    shrink = cfg.model.user_offset_reg / data.train_items.size  # the offset's penalty k / n * offset^2
    pop_bias = model.population_bias  # model.population_bias: b_pop, trained on the population loss alone
    pop_at = next((k for k, p in enumerate(params) if p is pop_bias), None)
    for _ in range(cfg.local.steps):
        pick = torch.from_numpy(rng.permutation(data.train_items.size)[: cfg.local.batch_size]).to(device)
        pred, _ = model(batch, user_x, model.item_input(items_x, features), None, neigh_x)
        loss = torch.mean((pred[pick] + offset - targets[pick]) ** 2)
        full = [p for p in params if p is not pop_bias]  # b_pop is not in the full prediction
        if map_at is not None:
            slopes += torch.autograd.grad(loss, pred, retain_graph=True)[0]
        grads = list(torch.autograd.grad(loss + shrink * offset ** 2,
                                         [*full, items_x, user_x, *([offset] if private else [])]))
        if private:
            *grads, g_offset = grads
        # uploads carry the gradient of the summed loss when local.loss = "sum": per-row
        # gradients then use the clip range instead of drowning in the LDP noise
        # (the item rows only under the paper's LDP, whose per-user uploads the server sees: a summed loss's weight
        # gradients would show it the rated rows; user-level DP scales the weights' too)
        scale = float(pick.numel()) if cfg.local.loss == "sum" else 1.0
        weight_scale = scale if cfg.privacy.mode == "user_dp" else 1.0
        step = [weight_scale * g for g in grads[: len(full)]] + [scale * grads[len(full)]]
        if pop_bias is not None:  # b_pop: the mean population loss's gradient, never scaled by the pick
            x = model.item_input(items_x, features)[pick]
            t = x[:, -1] if model.item_bias else torch.zeros(pick.numel(), device=targets.device)
            if model.item_bias_map is not None:
                t = t + x[:, : model.dim] @ model.item_bias_map
            (g_pop,) = torch.autograd.grad(torch.mean((pop_bias + t - targets[pick]) ** 2), [pop_bias])
            step.insert(pop_at, g_pop)
        if delta:  # each local step moves by the clipped gradient, as the server would apply it
            step = [torch.clamp(g, -cfg.privacy.clip_delta, cfg.privacy.clip_delta) for g in step]
        for acc, g in zip(grad_sum, step[: len(params)]):
            acc += g
        row_grad += step[len(params)]
        with torch.no_grad():  # the private embedding always follows the mean loss
            user_x -= cfg.local.user_lr * grads[-1]
            if private:
                offset -= cfg.local.user_lr * g_offset
            if delta:  # train the local copies: the next step starts where this one ends
                for p, g in zip(params, step[: len(params)]):
                    p -= cfg.local.lr * g
                items_x -= cfg.local.lr * step[len(params)]
        losses.append(loss.item())
    for _ in range(cfg.local.user_steps - 1):  # extra private steps: personalisation costs no privacy
        pred, _ = model(batch, user_x, model.item_input(items_x, features).detach(), None, neigh_x)
        g_user, *g_off = torch.autograd.grad(torch.mean((pred + offset - targets) ** 2) + shrink * offset ** 2,
                                             [user_x, *([offset] if private else [])])
        with torch.no_grad():
            user_x -= cfg.local.user_lr * g_user
            if private:
                offset -= cfg.local.user_lr * g_off[0]
    steps = 1 if delta else cfg.local.steps  # delta: the whole local change over lr; gradient: the mean
    maps = None if map_at is None else MapTerms(map_at, (slopes / steps).cpu().numpy(), set_x.cpu().numpy())
    return LocalStep(
        [(g / steps).cpu().numpy() for g in grad_sum],
        (row_grad / steps).cpu().numpy(),
        user_x.detach()[0].cpu().numpy(),
        float(np.mean(losses)),
        float(offset.detach()),
        maps,
    )




def oracle_uploads(users, weights: list[np.ndarray], rows: list[np.ndarray],
                   server_round: int) -> list[list[np.ndarray]]:
    """Each user's upload as the PyG step gives it alone: its round stream, dropout masks seeded from it
    through torch's global generator, the PyG step, then the product's own protection."""
    from fedrec_flwr.fedgnn.local_step import protected_upload
    from fedrec_flwr.fedgnn.user import set_weights

    out = []
    for user, r in zip(users, rows):
        rng, dropout_seed = user.begin_train(server_round)
        set_weights(user.model, weights)
        torch.manual_seed(dropout_seed)
        step = pyg_local_step(user.cfg, user.model, user.state, user.data, user.item_rows(r), rng, user.device)
        user.finish_train(step.embedding, step.offset, server_round)
        out.append(protected_upload(user.cfg, user.state, user.data, step, rng, user.device))
    return out


def pyg_evaluate(model: RatingGNN, state: UserState, data: UserData, item_rows: np.ndarray, low: float,
                 high: float, personal_shrink: float = 0.0) -> ErrorSums:
    """(SSE, SAE, n) of the user's clipped test predictions from PyG's layers on its star graph: the user node,
    its rated items, its neighbours, and its query items hanging off it (item rows: its anonymity set's). The
    population part (b_pop or b, plus the items' own terms) plus n / (n + k) of the rest; a cold user without
    neighbours predicts the population part alone where the model has b_pop."""
    model = ready(model, torch.device("cpu"), training=False)
    rows = lambda items: torch.from_numpy(item_rows[np.searchsorted(state.anonymity_ids, items)])  # noqa: E731
    batch = build_star_batch([data.train_items.size], [data.test_items.size], [state.neighbours.shape[0]])
    n = data.train_items.size
    with torch.no_grad():
        train_x = model.item_input(rows(data.train_items), _features_of(data, data.train_items, torch.device("cpu")))
        query_x = model.item_input(rows(data.test_items), _features_of(data, data.test_items, torch.device("cpu")))
        x, b = (query_x[:, :-1], query_x[:, -1]) if model.item_bias else (query_x, 0.0)
        first = model.population_bias if model.population_bias is not None else model.bias
        population = first + b + (x @ model.item_bias_map if model.item_bias_map is not None else 0.0)
        if n == 0 and state.neighbours.shape[0] == 0 and model.population_bias is not None:  # cold and alone
            return squared_error_sum(population.numpy(), data.test_values, low, high)
        _, pred = model(batch, torch.from_numpy(state.embedding[None, :]), train_x, query_x,
                        torch.from_numpy(state.neighbours))
        pred = pred + np.float32(state.offset)
        own = n / (n + personal_shrink) if personal_shrink and n else 1.0
        pred = population + own * (pred - population)
    return squared_error_sum(pred.numpy(), data.test_values, low, high)
