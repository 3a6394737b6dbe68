"""User-level differential privacy for FedGNN (`privacy.mode = user_dp`): what a node sends and what the server checks.

Each training round, on the device:
1. every user samples itself with probability q = clients_per_round / users from its own secure stream
   (`user_rng`: keyed by the device secret, which the server never holds): Poisson sampling that nobody
   else observes or can replay;
2. a sampled user runs the same local step as in the LDP mode (`local_step.run_local_steps`) and clips its
   whole update, the model gradient and the gradient of the item rows it rated, to L2 norm C (with
   privacy.population_clip, b_pop's pull on its own share of C and the rest on the remainder: `PopulationPull`);
3. its node adds the clipped updates of its sampled users into one vector over the model and the *whole*
   item table (unrated rows are zeros, so no row tells which items a user touched), plus its share of
   Gaussian noise, N(0, sigma^2 C^2 / K) with K the fewest nodes it lets a secure sum have (the noise
   floor, `device_policy.floor_nodes`), drawn from its secure stream: any sum of k >= K nodes carries
   N(0, sigma^2 C^2 k / K), at least the run's sigma C, and no party can remove or replay it (distributed DP);
4. SecAgg+ (Flower's `secaggplus_mod` / `SecAggPlusWorkflow`) masks the node's vector, so the server
   learns only the sum over all nodes.

On the server: the unmasked sum is checked (shapes, finite, an L2 norm an honest round can reach), divided
by the expected number of sampled users q N (below q = 1 the actual number is never known), and applied by the
server optimiser. sigma is computed from the run's config on every device and on the server alike
(`accounting.run_noise_multiplier`); each device also holds its own limits and ledger (`device_policy`) and
sits out a round that would break them, whatever the run config asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedrec_flwr.fedgnn.local_step import StepBatch, run_local_steps
from fedrec_flwr.fedgnn.protocol import RoundConfig, UploadRejected
from fedrec_flwr.fedgnn.user import FedGNNUser, check_download, user_rng
from fedrec_flwr.metrics import ErrorSums
from fedrec_flwr.models.rating_gnn import row_width
from fedrec_flwr.privacy.device_secret import DeviceSecret

# a user's streams for its sampling coin, and (first user of a node) the node's noise on its update and evaluation
COIN_STREAM, NOISE_STREAM, EVAL_NOISE_STREAM = 3, 5, 6
EVAL_ERROR_CLIP = 0.5  # of the scale's span: a released evaluation counts larger errors as half the scale
NOISE_TAIL = 8.0  # SecAgg+ clips each coordinate at h C + NOISE_TAIL x the noise's standard deviation
# the server's norm check: the noise's chi-square tails at e^-40 a side and the cross term at 9 deviations; the
# sampled users' count (`sample_count_bound`) is taken at 6 deviations, a looser tail for small q N
TAIL_LOG, TAIL_Z = 40.0, 9.0


def samples_itself(secret: DeviceSecret, user: int, server_round: int, q: float, attempt: int = 0) -> bool:
    """Whether `user` takes part in this round: a coin of probability q from its own secure stream (3, round,
    attempt: `FedGNNUser.round_key`)."""
    return bool(user_rng(secret, user, COIN_STREAM, server_round, attempt).random() < q)


def update_norms(steps: StepBatch) -> torch.Tensor:
    """The L2 norm of each user's update in a `StepBatch`: its model gradients and its real item rows together."""
    b = len(steps.counts)
    sq = torch.zeros(b, dtype=torch.float64, device=steps.rows.device)
    for g in steps.model_grads:
        sq += g.reshape(b, -1).double().square().sum(1)
    if steps.rows.shape[1]:
        real = torch.arange(steps.rows.shape[1], device=steps.rows.device)[None, :] < torch.tensor(
            steps.counts, device=steps.rows.device)[:, None]
        sq += (steps.rows.double().square().sum(2) * real).sum(1)
    return sq.sqrt()


@dataclass(frozen=True)
class PopulationPull:
    """How b_pop's pull (model.population_bias) enters a user's clipped update under user-level DP
    (privacy.population_clip > 0): on its own bound, out of the joint norm.

    Within the joint clip a user's pull is scaled by its clip factor, about 1/n for the summed loss, so b_pop
    settles at a mean over users dominated by light ones, not at the ratings' mean a cold user's ratings follow.
    Here the pull (twice the user's mean population residual, at most 2 span) is weighted by its ratings,
    min(n, m) / m, and scaled by share C / (2 span), so it never exceeds share C and is never clipped; the rest
    of the update is clipped to C sqrt(1 - share^2). The whole update's L2 norm stays at most C (per-part
    clipping, McMahan et al. 2018): the sensitivity, the noise and the accounting are unchanged."""

    index: int  # b_pop's position among the model's weights
    share: float  # privacy.population_clip: the pull's bound as a fraction of C, in [0, 1)
    ratings: int  # privacy.population_ratings: m, the ratings up to which a user's pull grows with its count
    span: float  # the rating scale's span (public)

    def bounded(self, pull: torch.Tensor, counts: list[int], clip_norm: float) -> torch.Tensor:
        """[B]: each user's pull weighted min(n, m) / m and scaled to at most share C (clamped there, whatever the
        step computed); NaN where the pull is not finite."""
        n = torch.tensor([min(float(c), self.ratings) for c in counts], device=pull.device, dtype=pull.dtype)
        most = self.share * clip_norm
        weighted = pull.reshape(len(counts)) * (n / self.ratings) * (most / (2.0 * self.span))
        # a pull that is not finite (NaN or +-inf) comes back as NaN, and `NodeSum.add` drops the whole user
        return torch.where(torch.isfinite(weighted), torch.clamp(weighted, -most, most),
                           torch.full_like(weighted, float("nan")))

    def rest(self, clip_norm: float) -> float:
        """The L2 bound left for the rest of the update: C sqrt(1 - share^2)."""
        return clip_norm * math.sqrt(1.0 - self.share**2)


class NodeSum:
    """The clipped updates of a node's sampled users summed over the model and the whole item table, in torch on
    the node's device; `noised` adds the node's share of the noise and returns the vector SecAgg+ masks."""

    def __init__(self, model_shapes: list[tuple[int, ...]], num_items: int, width: int, clip_norm: float,
                 device: torch.device, population: PopulationPull | None = None):
        self.model = [torch.zeros(shape, device=device) for shape in model_shapes]
        self.table = torch.zeros((num_items, width), device=device)
        self.clip_norm, self.device, self.population = clip_norm, device, population

    def add(self, steps: StepBatch, items: list[np.ndarray], include: list[bool] | None = None) -> None:
        """Clip each user's update of `steps` to L2 norm C and add it (`items[k]`: user k's rated item ids, the order
        of its real rows); `include[k]` False: user k's step was computed as cover only and adds nothing. With a
        `PopulationPull`, b_pop's pull is bounded on its own and the rest clipped to what remains of C."""
        pop = self.population
        pull = None
        if pop is not None:  # b_pop's slot out of the joint norm: its own bound, and the rest within the remainder
            pull = pop.bounded(steps.model_grads[pop.index], steps.counts, self.clip_norm)
            steps = steps._replace(model_grads=[torch.zeros_like(g) if i == pop.index else g
                                                for i, g in enumerate(steps.model_grads)])
        norms = update_norms(steps)
        bound = self.clip_norm if pop is None else pop.rest(self.clip_norm)
        scale = torch.clamp(bound / torch.clamp(norms, min=1e-12), max=1.0).float()
        if include is not None:
            scale = scale * torch.tensor([float(x) for x in include], device=scale.device)
        # a user whose update is not finite adds nothing (NaN * 0 is NaN, so its gradients are replaced, not scaled)
        finite = torch.isfinite(norms) if pull is None else torch.isfinite(norms) & torch.isfinite(pull)
        scale = torch.where(finite, scale, torch.zeros_like(scale))
        for acc, g in zip(self.model, steps.model_grads):
            acc += torch.tensordot(scale, torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0), dims=([0], [0]))
        if pull is not None:  # counted where the rest is: not for a cover step, nor for a non-finite update
            kept = torch.where(scale > 0, pull, torch.zeros_like(pull))  # a NaN pull has scale 0: never picked
            self.model[pop.index] += kept.sum().to(self.model[pop.index].dtype).reshape(self.model[pop.index].shape)
        for k, ids in enumerate(items):
            if ids.size and bool(scale[k] > 0):  # not a cover step, nor a non-finite update
                self.table.index_add_(0, torch.from_numpy(ids).to(self.device), steps.rows[k, : ids.size] * scale[k])

    def noised(self, std: float, rng: np.random.Generator) -> list[np.ndarray]:
        """[*model sums, table sum] + N(0, std^2) per coordinate from `rng`, the node's secure stream, drawn on the CPU
        (CPU and CUDA nodes draw the same numbers), as float32 numpy arrays in the model's parameter order, the
        table last."""
        out = []
        for part in (*self.model, self.table):
            noise = torch.from_numpy(rng.standard_normal(tuple(part.shape), dtype=np.float32)).to(self.device) \
                if std > 0 else 0.0
            # at least 1-D: Flower 1.42's SecAgg+ unmasks a 0-d array wrongly (it rebinds a numpy scalar in place)
            out.append((part + std * noise).cpu().numpy().astype(np.float32).reshape(part.shape or (1,)))
        return out


def population_pull(user: FedGNNUser) -> PopulationPull | None:
    """The device's `PopulationPull` (privacy.population_clip > 0 with model.population_bias), else None."""
    p = user.cfg.privacy
    names = [name for name, _ in user.model.named_parameters()]
    if p.population_clip <= 0 or "population_bias" not in names:
        return None
    return PopulationPull(names.index("population_bias"), float(p.population_clip), int(p.population_ratings),
                          float(user.meta.scale.span))


def node_update(users: list[FedGNNUser], weights: list[np.ndarray], table: np.ndarray, server_round: int,
                round_config: RoundConfig | None, batch: int, q: float, noise_std: float,
                cover: bool = False) -> list[np.ndarray]:
    """What one node sends in a user-DP training round: its sampled users' clipped updates summed (each user's coin
    of probability `q`), plus the node's noise share N(0, noise_std^2) per coordinate (`NodeSum`), drawn from the
    secure stream of its first user. The device computes q and the share itself (`device_policy.DeviceLimits`).
    `cover` (a deployed device): users that did not sample themselves run the same local step and discard it, so
    the device computes as long whatever its coins say, and no reply time shows them."""
    cfg = users[0].cfg
    check_download([*weights, table])  # before any coin or user's data: a refusal then reveals nothing
    check_download_shapes(users[0], weights, table)
    node = NodeSum([tuple(np.shape(w)) for w in weights], table.shape[0], table.shape[1], cfg.privacy.clip_norm,
                   users[0].device, population_pull(users[0]))
    coins = [samples_itself(cfg.secret, u.user, server_round, q, u.round_key(server_round)[1]) for u in users]
    work = users if cover else [u for u, c in zip(users, coins) if c]
    counts = coins if cover else [True] * len(work)

    def add_group(group: list[int], steps: StepBatch, rngs: list[np.random.Generator]) -> None:
        node.add(steps, [work[k].data.train_items for k in group], [counts[k] for k in group])
        for k, emb, off in zip(group, steps.embeddings, steps.offsets):
            # a cover step keeps nothing; a step a crafted download overflowed keeps the old state
            if counts[k] and np.isfinite(emb).all() and np.isfinite(off):
                work[k].finish_train(emb, float(off), server_round)

    run_local_steps(work, weights, [table] * len(work), server_round, round_config, batch, add_group)
    first = min(users, key=lambda u: u.user)
    return node.noised(noise_std, first.stream(NOISE_STREAM, server_round))


def check_download_shapes(user: FedGNNUser, weights: list[np.ndarray], table: np.ndarray) -> None:
    """ValueError unless the download has the model's shapes and the whole table's: checked before any coin is drawn,
    so a malformed download is refused by every device alike, whether its users sampled themselves or not."""
    expected = [tuple(p.shape) for p in user.model.parameters()]
    got = [tuple(np.shape(w)) for w in weights]
    if got != expected and got != [e or (1,) for e in expected]:
        raise ValueError(f"the download's model arrays have shapes {got[:4]}..., expected {expected[:4]}...")
    want = (user.meta.num_items, row_width(user.cfg.model))
    if np.shape(table) != want:
        raise ValueError(f"the download's item table has shape {np.shape(table)}, expected {want}")


def evaluation_vector(sums: ErrorSums, error_clip: float, max_ratings: int) -> np.ndarray:
    """One user's contribution to a released evaluation: w (SSE / c^2, SAE / c, n) / sqrt(3) with its errors clipped
    at c and w = min(1, m / n) / m (its weight capped at m = max_ratings ratings): each coordinate lies in
    [0, 1 / sqrt(3)], so adding or removing the user moves the released sums by at most 1 in L2 (a non-finite
    contribution counts as zero). The scale is the same for every user, so the decoded ratios are not biased."""
    n = float(sums.n)
    if not (math.isfinite(n) and n > 0):
        return np.zeros(3)
    w = min(1.0, max_ratings / n) / max_ratings
    # each error sum kept within [0, n] (of clipped errors), whatever called this: each coordinate in [0, 1/sqrt 3]
    v = np.array([min(max(sums.sse / error_clip**2, 0.0), n), min(max(sums.sae / error_clip, 0.0), n), n]) * w
    v /= math.sqrt(3.0)
    return v if np.isfinite(v).all() else np.zeros(3)  # a fixed scale: a data-dependent one would bias the ratios


def node_evaluation(users: list[FedGNNUser], weights: list[np.ndarray], table: np.ndarray, server_round: int,
                    max_ratings: int, noise_std: float) -> list[np.ndarray]:
    """What one node sends in a user-DP evaluation round: its users' `evaluation_vector`s summed (every user, each
    on its own test ratings against the whole table), plus its noise share N(0, noise_std^2) per coordinate from
    the secure stream of its first user; one float32 array of 3 (SecAgg+ masks it like a training vector)."""
    span = users[0].meta.scale.span
    clip = EVAL_ERROR_CLIP * span
    check_download([*weights, table])  # before any user's data: a refusal then reveals nothing
    total = np.zeros(3)
    for u in users:
        total += evaluation_vector(u.evaluate(weights, table, clip), clip, max_ratings)
    first = min(users, key=lambda u: u.user)
    noise = first.stream(EVAL_NOISE_STREAM, server_round).standard_normal(3) * noise_std
    return [(total + noise).astype(np.float32)]


def evaluation_metrics(arrays: list[np.ndarray], span: float, max_ratings: int, users: int,
                       noise_std: float) -> tuple[float, float, float]:
    """(RMSE, MAE, effective ratings) in reference units from a released evaluation sum, or UploadRejected when no
    honest round could give it (shape, non-finite, beyond every user's contribution plus the noise's tail) or its
    noisy count is not positive (too few users for this noise)."""
    if len(arrays) != 1 or np.shape(arrays[0]) != (3,):
        raise UploadRejected(f"the evaluation sum has arrays of shapes {[np.shape(a) for a in arrays]}, "
                             f"expected one (3,)")
    sse, sae, n = (float(x) for x in np.asarray(arrays[0], np.float64))
    limit = users + 8.0 * noise_std
    if not all(math.isfinite(x) and abs(x) <= limit for x in (sse, sae, n)):
        raise UploadRejected(f"the evaluation sum ({sse:.4g}, {sae:.4g}, {n:.4g}) is non-finite or past the "
                             f"{limit:.4g} that {users} users' clipped vectors and the noise reach")
    if n <= 0:
        raise UploadRejected(f"the evaluation sum's noisy count {n:.4g} is not positive: too few users for noise "
                             f"{noise_std:.3g}")
    clip = EVAL_ERROR_CLIP * span
    return clip * math.sqrt(max(sse, 0.0) / n), clip * max(sae, 0.0) / n, n * max_ratings * math.sqrt(3.0)


def secagg_clipping_range(clip_norm: float, users_per_node: int, share_std: float) -> float:
    """The per-coordinate range SecAgg+ keeps of a node's vector: its users' clipped sum can reach h C in one
    coordinate, and its noise share (standard deviation sigma C / sqrt(K), the floor's share) stays within
    NOISE_TAIL of them. A hostile node can put no more than this in any coordinate."""
    return users_per_node * clip_norm + NOISE_TAIL * max(share_std, 1e-3 * clip_norm)


def secagg_quantization_range(nodes: int, modulus: int = 2**32) -> int:
    """The largest power of two Q with nodes x Q below SecAgg+'s modulus (the sum of nodes' quantised values must
    not wrap around); ValueError when not even 2^16 levels fit."""
    q = 1 << max(int(math.floor(math.log2(max(modulus // (max(nodes, 1) + 1), 1)))), 0)
    if q < 2**16:
        raise ValueError(f"{nodes} SecAgg+ nodes leave fewer than 2^16 quantisation levels under the 2^32 modulus; "
                         "host more users per node (simulation.users_per_node)")
    return q


def sum_norm_bounds(coordinates: int, users: float, clip_norm: float, noise_std: float,
                    least_noise_std: float | None = None) -> tuple[float, float]:
    """(low, high): the squared L2 norm an honest user-DP sum S + Z lies within, except with probability below
    e^-TAIL_LOG per side. S is at most `users` clipped updates (|S| <= U C) and Z ~ N(0, noise_std^2 I_d):
    |S + Z|^2 = |S|^2 + 2 <S, Z> + |Z|^2, with <S, Z> ~ N(0, |S|^2 s^2) within TAIL_Z of its deviation and
    |Z|^2 / s^2 a chi-square of d degrees within Laurent and Massart's (2000) bounds d +- 2 sqrt(d x) (+ 2x).
    Because the noise's norm concentrates (its relative spread is 1 / sqrt(2d)), a sum scaled by other nodes'
    forged SecAgg+ weights, or one carrying much more than U C of extra signal, falls outside. `least_noise_std`:
    the least noise honest devices can add (a device whose own floor is stricter than the run's adds a smaller
    share), which sets the lower side; the run's `noise_std` by default."""
    d, x, z, s = float(coordinates), TAIL_LOG, TAIL_Z, noise_std
    signal = users * clip_norm
    high = signal**2 + 2.0 * z * signal * s + s**2 * (d + 2.0 * math.sqrt(d * x) + 2.0 * x)
    # min over |S| = t of t^2 - 2 z t s is -z^2 s^2: the signal can cancel at most that much of the noise's norm
    least = noise_std if least_noise_std is None else min(least_noise_std, noise_std)
    low = max(least**2 * (d - 2.0 * math.sqrt(d * x)) - (z * least) ** 2, 0.0)
    return low, high


def check_sum(arrays: list[np.ndarray], model_shapes: list[tuple[int, ...]], table_shape: tuple[int, int],
              clip_norm: float, noise_std: float, expected_users: float,
              least_noise_std: float | None = None, num_users: int | None = None) -> list[np.ndarray]:
    """The unmasked sum of a user-DP round as float32 arrays, or UploadRejected when no honest round could give it:
    wrong arrays or shapes, non-finite values, or a squared L2 norm outside `sum_norm_bounds` for the sampled users
    (at most C each, their count far into its binomial tail, never more than `num_users`) and the round's noise (at
    least `least_noise_std`)."""
    shapes = [*model_shapes, table_shape]
    if len(arrays) != len(shapes):
        raise UploadRejected(f"the aggregate has {len(arrays)} arrays, expected {len(shapes)} (model, item table)")
    out = []
    for i, (a, shape) in enumerate(zip(arrays, shapes)):
        a = np.asarray(a)
        if a.shape != (shape or (1,)) or not np.issubdtype(a.dtype, np.floating):  # scalars travel as (1,)
            raise UploadRejected(f"aggregate array {i}: {a.dtype} {a.shape}, expected float {shape or (1,)}")
        with np.errstate(over="ignore", invalid="ignore"):
            a = a.astype(np.float32)
        if not np.isfinite(a).all():
            raise UploadRejected(f"aggregate array {i} holds NaN/Inf")
        out.append(a.reshape(shape))
    squared = math.fsum(float(np.square(a, dtype=np.float64).sum()) for a in out)
    users = sample_count_bound(expected_users, num_users)
    low, high = sum_norm_bounds(sum(a.size for a in out), users, clip_norm, noise_std, least_noise_std)
    if not low <= squared <= high:
        raise UploadRejected(f"the aggregate's L2 norm {math.sqrt(squared):.6g} is outside the [{math.sqrt(low):.6g}, "
                             f"{math.sqrt(high):.6g}] that ~{users:.0f} clipped updates (C = {clip_norm:g}) and the "
                             f"noise (std {noise_std:.3g} a coordinate) reach")
    return out


def sample_count_bound(expected_users: float, num_users: int | None = None) -> float:
    """The most users an honest round samples: q N six deviations out. With the run's `num_users` N the count is
    binomial (std sqrt(q N (1 - q))) and at most N, so every user in every round (q = 1) allows exactly N; without
    it, the Poisson deviation sqrt(q N)."""
    if num_users is None:
        return expected_users + 6.0 * math.sqrt(max(expected_users, 1.0))
    q = min(max(expected_users / max(num_users, 1), 0.0), 1.0)
    return min(float(num_users), expected_users + 6.0 * math.sqrt(expected_users * (1.0 - q)))
