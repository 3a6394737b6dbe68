"""Attacks an honest-but-curious server (or neighbour service) can run on what it receives.

They measure the protections rather than assume them: `benchmarks.privacy_attack` and
`benchmarks.token_frequency_leak` are command lines over these functions, and the privacy tests
assert their bounds.

* Real vs pseudo item rows (FedGNN): inside one user's upload, rank the item-gradient rows by
  features the server can compute (`row_features`) and measure how well they separate the items
  the user rated from its pseudo items (`within_upload_auc`).
* Model gradients (FedGNN): match the top singular directions of the model's weight gradients (and,
  with public item features, the feature map's gradient) against what the server sent
  (`model_gradient_auc`).
* Set popularity (FedGNN): rank each user's anonymity set by how often each item appears in all the
  sets the server received, or by the true popularity, and measure how well that puts the real items
  first (`popularity_attack`); or by how strongly each item co-occurs with the set's other items in the
  other received sets (lift or cosine, `cooccurrence_attack`).
* Token frequencies (neighbour service): pair tokens ranked by how many users submitted them with
  items ranked by public popularity (`popularity_reidentification`).

AUCs are "real items score higher": 0.5 is chance.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch
from scipy import stats

from fedrec_flwr.config import AppConfig
from fedrec_flwr.data import UserData, UserPartitions, prepare_partitions
from fedrec_flwr.fedgnn.local_step import LocalStep, MapTerms, local_gradients, protected_upload
from fedrec_flwr.fedgnn.state import UserState
from fedrec_flwr.fedgnn.user import (
    DeviceSections,
    FedGNNUser,
    MemoryStore,
    init_user_state,
    own_items,
    popularity_report,
    user_rng,
)
from fedrec_flwr.models.rating_gnn import RatingGNN, build_model, row_width
from fedrec_flwr.privacy.popularity import estimate_counts

FEATURES = ("l2 norm", "l1 norm", "max |x|", "mean", "projection on mean row", "|top principal component|",
            "standardised distance", "|projection on the item-bias map|", "|projection on its sign pattern|",
            "distance off the top 2 principal components")
# the audit's item-bias map w (model.biases) where the model has one: the untrained model's is zero, which would hide
# the attack on it, so it is drawn at this standard deviation per entry, what a trained map holds (`quickstart`'s
# server after 150 rounds, `fedrec run --in-process --preset quickstart --set checkpoint.every=50 [model.dim=256
# data.item_features=true]`, read from checkpoint/server.pt: 0.096 at d = 32, 0.107 at d = 256). A server may send a
# larger one: `map_std` of the attacks
AUDIT_MAP_STD = 0.1
# the item rows the audit's server sends, per entry: the model's initial scale (model.init_std). A server may send
# larger ones, which scale every gradient up to the clip: `row_std` of the attacks
AUDIT_ROW_STD = 0.1
AUDIT_STREAM = 9  # the audited device's stream for its step (`user_rng`): fresh with every device secret


def row_features(rows: np.ndarray, item_map: np.ndarray | None = None) -> np.ndarray:
    """What an attacker can compute per row of one upload [rows, len(FEATURES)]: norms, extremes, mean,
    projections, outlyingness; from the model it sent, each row's projection on its item-bias map w and on
    w's sign pattern (`item_map`, the direction an item's own term w.x_i adds to its real rows' gradients, with 1
    for a bias column; None: the model has none, and those two features are 0 for every row); and each row's
    distance from the upload's top two principal directions (real rows lie near a low-rank subspace, their errors
    times a few shared vectors; pseudo rows carry the fit's shrinkage spread in every direction)."""
    centred = rows - rows.mean(0)
    axes = np.linalg.svd(centred, full_matrices=False)[2][:2]
    top = axes[0]
    scale = centred.std(0) + 1e-12
    direction = np.zeros(rows.shape[1], rows.dtype) if item_map is None else item_map
    return np.stack([
        np.linalg.norm(rows, axis=1), np.abs(rows).sum(1), np.abs(rows).max(1), rows.mean(1),
        rows @ rows.mean(0), np.abs(centred @ top), np.square(centred / scale).sum(1),
        np.abs(rows @ direction), np.abs(rows @ np.sign(direction)),
        np.linalg.norm(centred - (centred @ axes.T) @ axes, axis=1),
    ], 1)


def item_map_direction(model: RatingGNN, width: int) -> np.ndarray | None:
    """The direction w.x_i + b_i adds to a real row's gradient, as the server knows it from the model it sent: the
    item-bias map w over the embedding columns, 1 on a bias column (None without model.biases)."""
    if model.item_bias_map is None:
        return None
    w = model.item_bias_map.detach().cpu().numpy().astype(np.float32)
    return np.concatenate([w, np.ones(width - w.size, np.float32)])


class UserStep(NamedTuple):
    """One user's local step as the attacks see it.

    `sent`: the item rows the server sent for the user's anonymity set; `grads`, `real_rows`: the
    model gradients and the rated items' row gradients before protection; `rng`: the user's
    generator, positioned where the upload draws its pseudo rows and noise; `is_real`: which
    anonymity-set entries the user rated.
    """

    model: RatingGNN
    data: UserData
    state: UserState
    sent: np.ndarray
    grads: list[np.ndarray]
    real_rows: np.ndarray
    rng: np.random.Generator
    is_real: np.ndarray
    maps: MapTerms | None = None  # the item maps' slopes and the set's inputs, for the upload's pseudo terms

    def upload(self, cfg: AppConfig, map_terms: bool = True) -> list[np.ndarray]:
        """The protected upload of this step, as the device sends it (pseudo rows and noise from `rng`); with
        `map_terms` false, without the pseudo items' terms in the item maps' gradients (a strawman: the attacks'
        power)."""
        step = LocalStep(self.grads, self.real_rows, self.state.embedding, 0.0, self.state.offset,
                         self.maps if map_terms else None)
        return protected_upload(DeviceSections.from_config(cfg), self.state, self.data, step, self.rng)


def user_steps(cfg: AppConfig, users: int, map_std: float = AUDIT_MAP_STD,
               row_std: float = AUDIT_ROW_STD) -> Iterator[UserStep]:
    """For each of the first `users` users with >= 3 ratings, one local step on an untrained seeded model (its
    item-bias map, where it has one, drawn at `map_std` per entry: a trained one's by default, larger for a server
    that crafts it), with the item rows sent drawn at `row_std` per entry (the model's initial scale by default,
    larger for a server that crafts them).

    The model is seeded by cfg.seed and the rows sent to user u by u; the device's draws (its pseudo items, pseudo
    rows and noise) come from its secret, so a config with fixed device secrets yields the same numbers in every run
    and one with fresh secrets draws anew.
    """
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    torch.manual_seed(cfg.seed)  # model initialisation and dropout: the same numbers on every run
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)
    device_cfg = DeviceSections.from_config(cfg)
    popularity = None
    # the counts every user's report adds up to, as round 0 publishes them
    if cfg.privacy.pseudo_sampler == "popularity":
        reports = [popularity_report(device_cfg, meta, parts.user(u)) for u in range(meta.num_users)]
        popularity = estimate_counts(np.sum(reports, axis=0), len(reports), cfg.privacy.popularity_epsilon)
    if model.item_bias_map is not None:  # a trained model's map, not the untrained zero (`AUDIT_MAP_STD`)
        with torch.no_grad():
            model.item_bias_map.normal_(0.0, map_std)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    for u in range(min(users, meta.num_users)):
        data = parts.user(u)
        if data.train_items.size < 3:
            continue
        state = init_user_state(device_cfg, meta, data, popularity)
        model.load_state_dict(initial)  # every user steps from the same model (delta uploads move it locally)
        server = np.random.default_rng(u)  # the rows the server sends user u: the same in every run
        sent = (server.standard_normal((state.anonymity_ids.size, row_width(cfg.model))) * row_std).astype(np.float32)
        rng = user_rng(device_cfg.secret, u, AUDIT_STREAM)  # the device's own draws: its noise and pseudo rows
        step = local_gradients(device_cfg, model, state, data, sent, rng)
        grads, real_rows = step.model_grads, step.real_rows
        yield UserStep(model, data, state, sent, grads, real_rows, rng, np.isin(state.anonymity_ids, data.train_items),
                       step.maps)


def separation_auc(scores: np.ndarray, is_real: np.ndarray) -> float:
    """AUC of "real entries score higher than the others" (Mann-Whitney U / (real x others)); 0.5 is chance."""
    return float(stats.mannwhitneyu(scores[is_real], scores[~is_real]).statistic / (is_real.sum() * (~is_real).sum()))


def within_upload_auc(cfg: AppConfig, users: int, mode: str, map_std: float = AUDIT_MAP_STD) -> np.ndarray:
    """Per feature of `FEATURES`, the mean over users of the within-upload AUC of real vs pseudo rows,
    folded after averaging (max(auc, 1 - auc): the attacker may pick either direction).

    mode: "protected" (the upload as configured: pseudo rows, LDP if on), or "zeros" (pseudo rows
    left at zero, no noise: a strawman that shows the attack's power). `map_std`: the item-bias map's scale
    (`user_steps`).
    """
    aucs = []
    for step in user_steps(cfg, users, map_std):
        if mode == "zeros":
            up = np.zeros((step.state.anonymity_ids.size, row_width(cfg.model)), np.float32)
            up[step.is_real] = step.real_rows
        else:
            up = step.upload(cfg)[-1]
        feats = row_features(up, item_map_direction(step.model, up.shape[1]))
        aucs.append([separation_auc(feats[:, j], step.is_real) for j in range(feats.shape[1])])
    mean = np.mean(aucs, axis=0)
    return np.maximum(mean, 1 - mean)


def model_gradient_auc(cfg: AppConfig, users: int, map_std: float = AUDIT_MAP_STD,
                       row_std: float = AUDIT_ROW_STD, map_terms: bool = True) -> dict[str, float]:
    """Can the model part of an upload point at the real items? AUC of "real items score higher",
    averaged over users, not folded (0.5 = chance; the direction is known in advance).

    Two attacks by a server that knows every row it sent and the public item features:
    "sent rows vs weight gradients": a d x d weight's gradient sums terms (upstream error) x (input
    row) over the real items' edges, so its top singular vectors lean towards the real items' sent
    rows; item j scores its sent row's largest |projection| on them (the best d x d weight reported).
    "feature map" (models with public item features): the map's gradient is the sum over real j
    of f_j (x) g_j, so item j scores <map gradient, f_j (x) its uploaded row g_j>.
    "sent rows vs map gradients" (models with an item map, model.biases): a map w
    that reads an item's input x_j (w.x_j in the prediction) has the gradient sum over real j of c_j x_j, c_j the
    loss's slope at that prediction, so item j scores |<map gradient, x_j>|; and "map
    gradient vs uploaded row": the uploaded row carries c_j w too, so item j scores <map gradient, x_j> times
    <its uploaded row, w>.
    With model.item_bias both read the embedding part of a row (its first dim columns), where the
    weights and the feature map act; the bias column is not seen by them. `map_terms` false: the uploads without the
    pseudo items' map terms (`fedgnn.local_step.MapTerms`), which shows what the map attacks find without them.
    """
    d = cfg.model.dim
    per_weight: dict[int, list[float]] = {}
    feature_map: list[float] = []
    item_map: list[float] = []
    item_map_row: list[float] = []
    for step in user_steps(cfg, users, map_std, row_std):
        upload = step.upload(cfg, map_terms)
        names = [n for n, _ in step.model.named_parameters()]
        inputs = step.sent[:, :d]
        if step.data.item_features is not None:  # x_j = e_j + f_j W: the server sent W and knows f_j
            inputs = inputs + step.data.item_features[step.state.anonymity_ids] @ step.model.item_feature_map.detach(
            ).numpy()
        if step.model.item_bias_map is not None:
            read = inputs @ upload[names.index("item_bias_map")].reshape(-1)
            item_map.append(separation_auc(np.abs(read), step.is_real))
            along = upload[-1][:, :d] @ step.model.item_bias_map.detach().numpy()
            item_map_row.append(separation_auc(read * along, step.is_real))
        for i, p in enumerate(step.model.parameters()):
            if p.dim() < 2 or p.shape[-1] != d or p.shape[-2] != d:
                continue
            left, _, right = np.linalg.svd(upload[i].reshape(-1, d, d)[0])
            scores = np.maximum(np.abs(step.sent[:, :d] @ left[:, 0]), np.abs(step.sent[:, :d] @ right[0]))
            per_weight.setdefault(i, []).append(separation_auc(scores, step.is_real))
        if step.data.item_features is not None:
            g_map = upload[names.index("item_feature_map")]
            features = step.data.item_features[step.state.anonymity_ids]
            feature_map.append(separation_auc(np.einsum("jk,kl,jl->j", features, g_map, upload[-1][:, :d]),
                                              step.is_real))
    out = {"sent rows vs weight gradients": max(float(np.mean(v)) for v in per_weight.values())}
    if item_map:
        out["sent rows vs map gradients"] = float(np.mean(item_map))
        out["map gradient vs uploaded row"] = float(np.mean(item_map_row))
    if feature_map:
        out["feature map"] = float(np.mean(feature_map))
    return out


def popularity_reidentification(observed: np.ndarray, auxiliary: np.ndarray, rng: np.random.Generator,
                                top: int | None = None) -> float:
    """Fraction of tokens paired with their true item by rank: tokens ranked by their observed counts,
    items by auxiliary popularity (ties broken at random by `rng`), the i-th of each paired.

    observed, auxiliary: counts per item (a token stands for the item with a positive observed
    count); top: score only the `top` most frequent tokens.
    """
    items = np.flatnonzero(observed > 0)
    obs_order = items[np.lexsort((rng.random(items.size), -observed[items]))]
    aux_order = items[np.lexsort((rng.random(items.size), -auxiliary[items]))]
    hits = obs_order == aux_order
    return float(hits[:top].mean() if top else hits.mean())


class PopularityAttack(NamedTuple):
    """Mean over users of the per-user AUC and of the top-`top` precision, with the base rate (real share of a set)."""

    auc: float
    top_precision: float
    base_rate: float
    users: int


def popularity_attack(sets: dict[int, np.ndarray], own: dict[int, np.ndarray], scores: np.ndarray | None = None,
                      top: int = 10) -> PopularityAttack:
    """Rank each user's set by a per-item score and measure how often the real (own) items come first.

    `scores`: the attacker's popularity per item; None: how many of the received sets hold the item,
    which the server always has. Users whose set is all real or all pseudo are skipped (no ranking to
    score); ties are broken by item id, which carries no information.
    """
    num_items = int(max(int(s.max()) for s in sets.values() if s.size)) + 1
    if scores is None:
        scores = np.bincount(np.concatenate([np.asarray(s, np.int64) for s in sets.values()]), minlength=num_items)
    scores = np.asarray(scores, np.float64)
    return _ranked_sets(sets, own, list(sets), lambda ids: scores[ids], top)


def _ranked_sets(sets: dict[int, np.ndarray], own: dict[int, np.ndarray], users: list[int],
                 scores_of: Callable[[np.ndarray], np.ndarray], top: int, min_size: int = 1) -> PopularityAttack:
    """Mean over `users` of the per-user AUC of `scores_of(its set)` for "real items first", the real share of the
    top-`top` ranked (ties broken by item id, which carries no information) and the base rate. Users whose set is
    all real, all pseudo or smaller than `min_size` are skipped (no ranking to score)."""
    aucs, tops, bases = [], [], []
    for u in users:
        ids = np.asarray(sets[u], np.int64)
        is_real = np.isin(ids, own[u])
        if is_real.all() or not is_real.any() or ids.size < min_size:
            continue
        scores = scores_of(ids)
        aucs.append(separation_auc(scores, is_real))
        order = np.lexsort((ids, -scores))
        tops.append(float(is_real[order[:top]].mean()))
        bases.append(float(is_real.mean()))
    return PopularityAttack(float(np.mean(aucs)), float(np.mean(tops)), float(np.mean(bases)), len(aucs))


def cooccurrence_attack(sets: dict[int, np.ndarray], own: dict[int, np.ndarray], how: str = "lift",
                        top: int = 10) -> PopularityAttack:
    """Rank each item of a user's set by how strongly it co-occurs with the set's other items across all the other
    received sets, and measure how often the real (own) items come first.

    Real items are rated together (taste), pseudo items are drawn independently of each other, so a real item's
    mean association with its set is higher. Co-occurrence counts leave the user's own set out; `how`: "lift"
    (pairs seen together over what their counts predict) or "cosine" (pairs over the geometric mean of counts).
    """
    num_items = int(max(int(s.max()) for s in sets.values() if s.size)) + 1
    users = sorted(sets)
    x = np.zeros((len(users), num_items), np.float32)
    for row, u in enumerate(users):
        x[row, np.asarray(sets[u], np.int64)] = 1.0
    pairs = x.T @ x  # items x items: how many sets hold both
    counts = x.sum(0)

    def scores_of(ids: np.ndarray) -> np.ndarray:  # each item's mean association with the set's other items
        together = pairs[np.ix_(ids, ids)] - 1.0  # the other sets only
        n = np.maximum(counts[ids] - 1.0, 1.0)
        assoc = (together * (len(users) - 1) / np.outer(n, n) if how == "lift"
                 else together / np.sqrt(np.outer(n, n)))
        np.fill_diagonal(assoc, 0.0)
        return assoc.sum(1) / (ids.size - 1)

    return _ranked_sets(sets, own, users, scores_of, top, min_size=3)


def registration_popularity_attack(cfg: AppConfig) -> dict:
    """Register every user of cfg's dataset through the round core (in-process, as a run does) and rank each
    anonymity set the server then holds by (a) how many received sets hold each item, which it always knows,
    and (b) the true training popularity, which a stronger server may have from public data: each attack's
    mean per-user AUC (`popularity_attack`), with the users, items and mean set size."""
    from fedrec_flwr.cli.inprocess import register_users
    from fedrec_flwr.fedgnn.bindings import NodeBindings
    from fedrec_flwr.fedgnn.rounds import FedGNNRounds
    from fedrec_flwr.fedgnn.server import FedGNNServer

    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    server = FedGNNServer.from_config(cfg, meta.num_items, meta.scale.midpoint,
                                      num_item_features=meta.num_item_features)
    rounds = FedGNNRounds.from_config(cfg, server, NodeBindings(meta.num_users, block_size=1),
                                      meta.scale.span)
    store = MemoryStore()
    users = [u for u in range(meta.num_users) if parts.user(u).train_items.size]
    device_cfg = DeviceSections.from_config(cfg)
    model = build_model(cfg.model, meta.scale.midpoint, meta.num_item_features)  # one device model, shared in turn
    register_users(rounds, users, lambda u: FedGNNUser(device_cfg, meta, parts.user(u), store, model=model))
    own = {u: own_items(parts.user(u)) for u in users}
    train_popularity = np.zeros(meta.num_items)
    for u in users:
        train_popularity[parts.user(u).train_items] += 1
    sets = dict(server.anonymity_sets)
    out = {"users": len(users), "items": meta.num_items,
           "mean_set_size": float(np.mean([s.size for s in sets.values()])), "rejected": len(rounds.rejections)}
    for name, scores in (("observed set counts", None), ("true training popularity", train_popularity)):
        out[name] = popularity_attack(sets, own, scores)._asdict()
    for how in ("lift", "cosine"):
        out[f"co-occurrence {how}"] = cooccurrence_attack(sets, own, how)._asdict()
    return out
