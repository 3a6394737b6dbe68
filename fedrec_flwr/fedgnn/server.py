"""The FedGNN recommendation server without Flower: upload validation, pseudo-item gradient
merging, the server optimiser step, round schedule and checkpoints.

`strategies.fedgnn.FedGNNStrategy` puts this behind Flower's Strategy API; GPU and
sweep benchmarks drive it directly (it needs only numpy and torch).

The server reads only its sections: `model`, `server_opt`, `merge`, `privacy` and the run's seed;
`FedGNNServer.from_config` picks them out of a run's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedrec_flwr.config import (
    MergeConfig,
    ModelConfig,
    PrivacyConfig,
    ServerOptConfig,
)
from fedrec_flwr.fedgnn.protocol import (
    UploadRejected,
)
from fedrec_flwr.models.rating_gnn import build_model, row_width
from fedrec_flwr.privacy.popularity import estimate_counts
from fedrec_flwr.privacy_modes import privacy_mode

if TYPE_CHECKING:
    from fedrec_flwr.config import AppConfig


def check_anonymity_set(ids: np.ndarray, num_items: int, min_rows: int) -> np.ndarray:
    """An anonymity set, checked: 1-D integer, >= min_rows ids, in range, no duplicates."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UploadRejected(f"item ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size < min_rows:
        raise UploadRejected(f"upload has {ids.size} item rows, fewer than the required {min_rows}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_items):
        raise UploadRejected(f"item id out of range [0, {num_items})")
    if np.unique(ids).size != ids.size:
        raise UploadRejected("duplicate item ids")
    return ids.astype(np.int64)


def validate_upload(
    arrays: list[np.ndarray], model_shapes: list[tuple[int, ...]], dim: int, num_items: int, min_rows: int,
    registered: np.ndarray | None,
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Split and check one user's training upload: (model grads, item ids, item rows) or UploadRejected.

    `dim`: the width of one item row (`models.row_width`: the model's dim, + 1 with model.item_bias)."""
    n = len(model_shapes)
    if len(arrays) != n + 2:
        raise UploadRejected(f"expected {n + 2} arrays (model grads, ids, rows), got {len(arrays)}")
    grads = []
    for i, (a, shape) in enumerate(zip(arrays[:n], model_shapes)):
        a = np.asarray(a)
        if a.shape != shape:
            raise UploadRejected(f"model gradient {i} has shape {a.shape}, expected {shape}")
        grads.append(_as_server_floats(a, f"model gradient {i}"))
    ids = check_anonymity_set(arrays[n], num_items, min_rows)
    rows = np.asarray(arrays[n + 1])
    if rows.shape != (ids.size, dim):
        raise UploadRejected(f"item rows have shape {rows.shape}, expected {(ids.size, dim)}")
    rows = _as_server_floats(rows, "item rows")
    if registered is not None and not np.array_equal(ids, registered):
        raise UploadRejected("item ids differ from the anonymity set the client registered")
    return grads, ids, rows


def _as_server_floats(a: np.ndarray, what: str) -> np.ndarray:
    """`a` as the server's float32, refused unless it is a float array whose values and squares (Adam's
    second moment) stay finite after the cast: 1e300 sent as float64 becomes inf in float32."""
    if not np.issubdtype(a.dtype, np.floating):
        raise UploadRejected(f"{what} have dtype {a.dtype}, expected a float dtype")
    with np.errstate(over="ignore", invalid="ignore"):
        out = a.astype(np.float32)
        if not np.isfinite(np.square(out)).all():
            raise UploadRejected(f"{what} have NaN/Inf or values too large for float32 arithmetic")
    return out


def merge_item_gradients(
    uploads: list[tuple[np.ndarray, np.ndarray]], num_items: int, dim: int, normalise: str
) -> tuple[np.ndarray, np.ndarray]:
    """(touched ids, merged rows): per-item sum divided by |S| ("clients") or by its count ("count")."""
    total = torch.zeros((num_items, dim), dtype=torch.float64)
    count = np.zeros(num_items, np.int64)
    for ids, rows in uploads:  # ids are unique within an upload (validated)
        total.index_add_(0, torch.from_numpy(ids), torch.from_numpy(rows).double())
        count[ids] += 1
    total = total.numpy()
    touched = np.flatnonzero(count)
    denom = count[touched][:, None] if normalise == "count" else max(len(uploads), 1)
    return touched, (total[touched] / denom).astype(np.float32)


def robust_location(stack: np.ndarray, how: str, trim_fraction: float) -> np.ndarray:
    """Coordinate-wise location over axis 0 of `stack` (NaN marks a missing value): "mean", "median", or
    "trimmed" mean dropping floor(trim_fraction * k) values at each end of the k present ones."""
    if how == "mean":
        return np.nanmean(stack, axis=0)
    if how == "median":
        return np.nanmedian(stack, axis=0)
    k = np.sum(~np.isnan(stack), axis=0)
    t = np.floor(trim_fraction * k)
    ordered = np.sort(stack, axis=0)  # NaN sort last
    rank = np.arange(stack.shape[0]).reshape((-1,) + (1,) * (stack.ndim - 1))
    keep = (rank >= t) & (rank < k - t)
    return np.where(keep, ordered, 0.0).sum(axis=0) / np.maximum(k - 2 * t, 1)


def robust_merge_items(uploads: list[tuple[np.ndarray, np.ndarray]], num_items: int, dim: int, normalise: str,
                       how: str, trim_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(touched ids, merged rows) like `merge_item_gradients`, with each item's rows combined by `how` over
    the uploads that carry it; "clients" then scales by count / |S| so that "mean" equals sum / |S|."""
    count = np.zeros(num_items, np.int64)
    for ids, _ in uploads:
        count[ids] += 1
    touched = np.flatnonzero(count)
    slot = np.full(num_items, -1, np.int64)
    slot[touched] = np.arange(touched.size)
    stack = np.full((len(uploads), touched.size, dim), np.nan, np.float64)
    for j, (ids, rows) in enumerate(uploads):
        stack[j, slot[ids]] = rows
    merged = robust_location(stack, how, trim_fraction)
    if normalise == "clients":
        merged = merged * (count[touched][:, None] / max(len(uploads), 1))
    return touched, merged.astype(np.float32)


def sample_users(seed: int, logical_round: int, users: list[int], k: int) -> list[int]:
    """The users trained in a round: a seeded sample of the sorted registered users (node ids play no part)."""
    ordered = sorted(users)
    rng = np.random.default_rng([seed, logical_round])
    return sorted(ordered[i] for i in rng.choice(len(ordered), size=min(k, len(ordered)), replace=False))


def eval_users(seed: int, users: list[int], fraction: float) -> list[int]:
    """The users that evaluate: all, or a fixed seeded sample (the same every evaluation round)."""
    ordered = sorted(users)
    if fraction >= 1.0 or not ordered:
        return ordered
    k = max(1, int(round(fraction * len(ordered))))
    rng = np.random.default_rng([seed, 4099])
    return sorted(ordered[i] for i in rng.choice(len(ordered), size=k, replace=False))


@dataclass
class TrainUpdate:
    """One user's validated training upload."""

    user: int
    grads: list[np.ndarray]
    ids: np.ndarray
    rows: np.ndarray


class FedGNNServer:
    """What the recommendation server holds and does: model, item table, optimisers, the users' anonymity sets."""

    def __init__(self, num_items: int, bias_init: float, *, model: ModelConfig, server_opt: ServerOptConfig,
                 merge: MergeConfig, privacy: PrivacyConfig, seed: int, device: torch.device | None = None,
                 num_item_features: int = 0):
        self.num_items, self.num_item_features = num_items, num_item_features
        # `self.model` is the torch model; its section is `model_cfg`
        self.model_cfg, self.server_opt, self.merge, self.privacy, self.seed = model, server_opt, merge, privacy, seed
        # the privacy mode's device side: whether users register anonymity sets and report popularity first
        self.device_mechanism = privacy_mode(privacy.mode).device(privacy)
        self.row_width = row_width(model)  # the width of an item row: the table's, every download's and upload's
        self.device = device or torch.device("cpu")
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        self.model = build_model(model, bias_init, num_item_features).to(self.device)
        table = torch.randn(num_items, model.dim, generator=gen) * model.init_std
        if self.row_width > model.dim:  # model.item_bias: the last column is each item's bias b_i, starting at 0
            table = torch.cat([table, torch.zeros(num_items, self.row_width - model.dim)], 1)
        self.items = torch.nn.Parameter(table.to(self.device))
        params = list(self.model.parameters())
        so = server_opt
        # server_opt.population_lr: b_pop in a group of its own (one group otherwise, as checkpoints hold it); the
        # groups keep model.parameters() order, in which a checkpoint's optimiser state is numbered
        pop = self.model.population_bias
        at = next((k for k, p in enumerate(params) if p is pop), None)
        groups = params if at is None or not so.population_lr else [
            g for g in ({"params": params[:at]}, {"params": [pop], "lr": so.population_lr},
                        {"params": params[at + 1:]}) if g["params"]]
        if so.name == "adam":
            self.model_opt = torch.optim.Adam(groups, lr=so.lr)
            self.item_opt = torch.optim.SparseAdam([self.items], lr=so.item_rate, betas=(so.item_beta1, 0.999))
        else:
            self.model_opt = torch.optim.SGD(groups, lr=so.lr, momentum=so.momentum)
            self.item_opt = torch.optim.SGD([self.items], lr=so.item_rate)
        # ExponentialLR decays each group's current rate in place, so the optimiser state in a checkpoint carries it
        self.lr_schedules = [torch.optim.lr_scheduler.ExponentialLR(opt, so.lr_decay)
                             for opt in (self.model_opt, self.item_opt)]
        self.model_shapes = [tuple(p.shape) for p in params]
        self.anonymity_sets: dict[int, np.ndarray] = {}  # user id -> its anonymity set (int32 to halve memory)
        # popularity-matched sampler: the item counts estimated from the users' LDP reports, published at registration
        self.popularity: np.ndarray | None = None

    @classmethod
    def from_config(cls, cfg: AppConfig, num_items: int, bias_init: float, device: torch.device | None = None,
                    num_item_features: int = 0) -> FedGNNServer:
        """The server of one run: its model, server optimiser, merge and privacy sections and its seed."""
        return cls(num_items, bias_init, model=cfg.model, server_opt=cfg.server_opt, merge=cfg.merge,
                   privacy=cfg.privacy, seed=cfg.seed, device=device, num_item_features=num_item_features)

    # -- what goes out ---------------------------------------------------------------
    def model_weights(self) -> list[np.ndarray]:
        """Current model weights as numpy arrays (copied)."""
        return [p.detach().cpu().numpy().copy() for p in self.model.parameters()]

    def rows_for(self, user: int) -> np.ndarray:
        """Global embeddings of the user's anonymity set, in ascending id order."""
        ids = torch.from_numpy(self.anonymity_sets[user].astype(np.int64)).to(self.device)
        return self.items.detach()[ids].cpu().numpy()

    def min_rows(self) -> int:
        """Rows every upload must carry: M (uniform sampler) or 1 + ratio (popularity-matched), at most the
        catalogue."""
        p = self.privacy
        if self.device_mechanism.whole_table:  # no anonymity sets: an empty one registered, the whole table down
            return 0
        return min(p.pseudo_ratio + 1 if p.pseudo_sampler == "popularity" else p.pseudo_items, self.num_items)

    def table(self) -> np.ndarray:
        """The whole item table (what a user-DP download carries, so the server cannot tell which items a user
        wants)."""
        return self.items.detach().cpu().numpy().copy()

    def registration_download(self) -> list[np.ndarray]:
        """What registration sends every node: nothing, or the published item counts the matched sampler needs."""
        if not self.device_mechanism.reports_popularity():
            return []
        if self.popularity is None:
            raise RuntimeError("the popularity-matched sampler needs the users' popularity reports before registration")
        return [self.popularity.copy()]

    def publish_popularity(self, bit_sums: np.ndarray, reports: int) -> None:
        """Estimate item counts from the sum of `reports` checked LDP reports (`fedrec_flwr.privacy.popularity`)."""
        self.popularity = estimate_counts(bit_sums, reports, self.privacy.popularity_epsilon)

    # -- what comes in ---------------------------------------------------------------
    def register(self, user: int, ids: np.ndarray) -> None:
        """Record a user's anonymity set after checking it."""
        ids = check_anonymity_set(ids, self.num_items, self.min_rows())
        if self.device_mechanism.whole_table and ids.size:
            raise UploadRejected(f"this privacy mode has no anonymity sets; user {user} registered {ids.size} item ids")
        self.anonymity_sets[user] = ids.astype(np.int32)

    def validate(self, user: int, arrays: list[np.ndarray]) -> TrainUpdate:
        """One user's upload checked against the model shapes and its registered set."""
        registered = self.anonymity_sets.get(user)
        if registered is None:
            raise UploadRejected(f"user {user} is not registered")
        grads, ids, rows = validate_upload(arrays, self.model_shapes, self.row_width, self.num_items,
                                           self.min_rows(), registered.astype(np.int64))
        return TrainUpdate(user, grads, ids, rows)

    def apply_sum(self, model_sums: list[np.ndarray], table_sum: np.ndarray, users: float) -> None:
        """Step the server optimisers on a user-DP round's noisy sum, divided by the expected number of sampled users
        (fixed, as in DP-FedAvg: the actual number is private). Every row of the table moves (noise reaches all)."""
        self.model_opt.zero_grad()
        for p, g in zip(self.model.parameters(), model_sums):
            mean = np.asarray(np.asarray(g, np.float32) / np.float32(users), np.float32)
            p.grad = torch.from_numpy(mean).reshape(p.shape).to(self.device)
        self.model_opt.step()
        self._step_items(np.arange(self.num_items), np.asarray(table_sum, np.float32) / np.float32(users))

    def _step_items(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """One item-optimiser step on the gradient `rows` of the (sorted, unique) `ids`, then the decay and
        schedules."""
        self.item_opt.zero_grad()
        index = torch.from_numpy(ids)[None, :].to(self.device)
        # merged ids are sorted, unique and in range (flatnonzero of a count over validated ids): skip the check
        grad = torch.sparse_coo_tensor(index, torch.from_numpy(rows).to(self.device), self.items.shape,
                                       check_invariants=False)
        self.items.grad = grad.coalesce() if isinstance(self.item_opt, torch.optim.SparseAdam) else grad.to_dense()
        self.item_opt.step()
        decay = self.server_opt.item_weight_decay
        if decay:  # decoupled from the gradient step, at the item table's current (decayed) rate
            with torch.no_grad():
                self.items.mul_(1.0 - self.item_opt.param_groups[0]["lr"] * decay)
        for schedule in self.lr_schedules:
            schedule.step()

    def apply(self, updates: list[TrainUpdate]) -> None:
        """Average model gradients over |S|, merge item rows by id, step the server optimisers.

        Updates are summed in user order, in float64, so the result does not depend on the order in which
        Flower delivers them (a resumed run must match an uninterrupted one bit for bit).
        """
        updates = sorted(updates, key=lambda u: u.user)
        s = len(updates)
        self.model_opt.zero_grad()
        merge = self.merge
        for i, p in enumerate(self.model.parameters()):
            if merge.robust == "mean":
                mean = np.asarray(sum(u.grads[i].astype(np.float64) for u in updates) / s, np.float32)
            else:
                stack = np.stack([u.grads[i].astype(np.float64) for u in updates])
                mean = np.asarray(robust_location(stack, merge.robust, merge.trim_fraction), np.float32)
            p.grad = torch.from_numpy(mean).reshape(p.shape).to(self.device)
        self.model_opt.step()
        uploads = [(u.ids, u.rows - u.rows.mean(0) if merge.center_uploads else u.rows) for u in updates]
        if merge.robust == "mean":
            ids, rows = merge_item_gradients(uploads, self.num_items, self.row_width, merge.items)
        else:
            ids, rows = robust_merge_items(uploads, self.num_items, self.row_width, merge.items,
                                           merge.robust, merge.trim_fraction)
        self._step_items(ids, rows)

    # -- checkpoints (persisted by fedrec_flwr.fedgnn.checkpoint.Checkpointer) -----------
    def state(self) -> dict:
        """Model, item table, optimiser and RNG state: what a checkpoint needs to continue this server."""
        return {"model": self.model.state_dict(), "items": self.items.detach().cpu(),
                "model_opt": self.model_opt.state_dict(), "item_opt": self.item_opt.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "popularity": None if self.popularity is None else torch.from_numpy(self.popularity.copy())}

    def restore(self, ckpt: dict) -> None:
        """Put the server back in the state `state()` recorded."""
        self.model.load_state_dict(ckpt["model"])
        with torch.no_grad():
            self.items.copy_(ckpt["items"].to(self.device))
        self.model_opt.load_state_dict(ckpt["model_opt"])
        self.item_opt.load_state_dict(ckpt["item_opt"])
        torch.set_rng_state(ckpt["torch_rng"])
        popularity = ckpt.get("popularity")
        self.popularity = None if popularity is None else popularity.numpy().astype(np.float32)
