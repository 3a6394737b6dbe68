"""One FPPDM domain without Flower: its user-item graph, Gaussian LightGCN, W2 metric-loss training and
leave-one-out ranking evaluation. Needs only numpy, scipy and torch (GPU benchmarks drive it on
machines without flwr); `clients.fppdm` wraps it in Flower's NumPyClient.
"""

from __future__ import annotations

import numpy as np
import torch

from fedrec_flwr.config import (
    CoClusteringConfig,
    FPPDMEvaluationConfig,
    FPPDMModelConfig,
    FPPDMTrainingConfig,
)
from fedrec_flwr.data import Domain
from fedrec_flwr.fppdm.bounds import derived_value_bounds
from fedrec_flwr.fppdm.coclustering import cluster_users
from fedrec_flwr.metrics import (
    hit_ratio_at_k,
    ndcg_at_k,
    rank_of_positive,
    sample_negatives,
)
from fedrec_flwr.models.gaussian_gcn import (
    GaussianLightGCN,
    normalised_adjacency,
    w2_squared,
)


class DomainData:
    """A domain re-indexed locally: users 0..n-1 (with their global ids), items as given.

    The user rows are the domain's users with training positives (`global_ids`, the users it uploads),
    then its cold test users (`cold_ids`: a test item but no training positive here). A cold user's row
    is an isolated node of the graph: it is never trained, never uploaded, and ranks its test item from
    its distribution as initialised, so every test user of the domain is ranked.
    """

    def __init__(self, domain: Domain):
        self.name = domain.name
        self.num_items = domain.num_items
        self.global_ids = np.unique(domain.train_users)
        self.cold_ids = np.setdiff1d(domain.test_users, self.global_ids)
        self.row_ids = np.concatenate([self.global_ids, self.cold_ids]).astype(np.int64)
        self.local_of = {int(g): i for i, g in enumerate(self.global_ids)}
        self.users = np.searchsorted(self.global_ids, domain.train_users)
        row_of = {int(g): i for i, g in enumerate(self.row_ids)}
        self.test_users = np.array([row_of[int(g)] for g in domain.test_users], np.int64)
        self.test_items = domain.test_items.astype(np.int64)
        self.items = domain.train_items.astype(np.int64)
        self.positives = [set() for _ in self.row_ids]
        for u, i in zip(self.users, self.items):
            self.positives[u].add(int(i))
        self._pair_keys = np.unique(self.users * self.num_items + self.items)

    @property
    def num_uploaded(self) -> int:
        """Users with at least one training positive in this domain: the ones it trains and uploads."""
        return int(self.global_ids.size)

    @property
    def num_users(self) -> int:
        """User rows of the domain's graph: its users with training positives, then its cold test users."""
        return int(self.row_ids.size)

    def is_positive(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Vectorised membership test of (user, item) pairs in the training positives."""
        keys = users * self.num_items + items
        pos = np.searchsorted(self._pair_keys, keys)
        pos = np.minimum(pos, self._pair_keys.size - 1)
        return self._pair_keys[pos] == keys


def sample_training_negatives(rng: np.random.Generator, data: DomainData, users: np.ndarray) -> np.ndarray:
    """One uniformly drawn non-positive item per user (rejection sampling, vectorised)."""
    neg = rng.integers(0, data.num_items, size=users.size)
    bad = data.is_positive(users, neg)
    while bad.any():
        neg[bad] = rng.integers(0, data.num_items, size=int(bad.sum()))
        bad = data.is_positive(users, neg)
    return neg


class DomainTrainer:
    """The domain's model and its training/evaluation, independent of Flower.

    Reads the `fppdm.model`, `fppdm.training` and `fppdm.coclustering` sections and the run seed;
    `evaluate` takes `fppdm.evaluation`.
    """

    fused_adam = True  # with row propagation; false: torch's default Adam kernels, as the reference path uses

    def __init__(self, data: DomainData, domain_index: int, model: FPPDMModelConfig, training: FPPDMTrainingConfig,
                 coclustering: CoClusteringConfig, seed: int, device: torch.device | None = None,
                 value_bound: tuple[float, float] | None = None):
        self.data, self.domain_index, self.seed = data, domain_index, seed
        self.model_cfg, self.training, self.coclustering = model, training, coclustering
        self.device = device or torch.device("cpu")
        torch.manual_seed(seed * 1000 + domain_index)
        adj = normalised_adjacency(data.num_users, data.num_items, data.users, data.items)
        # the run's value bounds (`fppdm.rounds.value_bounds`; derived from the margin unless given): every
        # distribution the model outputs, so every upload, lies inside what the server accepts
        bound = value_bound or derived_value_bounds(training.margin)
        self.model = GaussianLightGCN(data.num_users, data.num_items, model.dim, model.layers, adj, model.gaussian,
                                      bound).to(self.device)
        if model.shared_user_init:
            self._init_users_by_global_id()

    @property
    def dim(self) -> int:
        """Size of every user's and item's mu and sigma."""
        return self.model_cfg.dim

    def _init_users_by_global_id(self) -> None:
        """Start each user's parameters from a draw seeded by (run seed, global user id): every domain
        holding a user starts it at the same point, as if the server had sent one initial global
        model, so the domains' user spaces start aligned and their barycenter is meaningful."""
        mu = np.empty((self.data.num_users, self.dim), np.float32)
        sigma = np.empty_like(mu)
        for i, g in enumerate(self.data.row_ids):
            draw = np.random.default_rng([self.seed, 31, int(g)]).standard_normal((2, self.dim)) * 0.1
            mu[i], sigma[i] = draw
        with torch.no_grad():
            self.model.mu[: self.data.num_users] = torch.from_numpy(mu).to(self.device)
            self.model.sigma_raw[: self.data.num_users] = torch.from_numpy(sigma).to(self.device)

    def state(self) -> dict[str, np.ndarray]:
        """Model parameters, for the node's own state between rounds."""
        return {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items() if k != "adj"}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore parameters saved by `state()`."""
        with torch.no_grad():
            for k, v in arrays.items():
                getattr(self.model, k).copy_(torch.from_numpy(v))

    def user_distributions(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu, sigma) after propagation of the domain's users with training positives (what it uploads)."""
        with torch.no_grad():
            mu, sigma = self.model()
        n = self.data.num_uploaded
        return mu[:n].cpu().numpy(), sigma[:n].cpu().numpy()

    def train(self, server_round: int, global_ids: np.ndarray, global_mu: np.ndarray,
              global_sigma: np.ndarray) -> float:
        """`local_epochs` epochs of hinge(margin + W2(u,pos) - W2(u,neg)) + lambda_P W2(u, global u)
        (+ lambda_C W2(u, its cluster) for FPPDM++).

        Every step propagates the current parameters afresh (as the paper does); with
        `fppdm.training.row_propagation` (CPU) it computes only the rows of the propagation its batch's
        users and items depend on, which gives the same values and gradients as the whole graph.
        """
        d, f, cc = self.data, self.training, self.coclustering
        rng = np.random.default_rng([self.seed, self.domain_index, server_round])
        rows = f.row_propagation and self.model.rows_supported()
        # fused: Adam's update in one pass over each table instead of several (the same maths; its float
        # rounding differs from the unfused kernels' in the last bits)
        opt = torch.optim.Adam(self.model.parameters(), lr=f.lr, fused=True if rows and self.fused_adam else None)
        has_global = np.zeros(d.num_users, bool)
        g_mu = torch.zeros(d.num_users, self.dim, device=self.device)
        g_sigma = torch.ones(d.num_users, self.dim, device=self.device)
        if global_ids.size:
            local = np.array([d.local_of.get(int(g), -1) for g in global_ids])
            ok = local >= 0
            has_global[local[ok]] = True
            g_mu[torch.from_numpy(local[ok])] = torch.from_numpy(global_mu[ok]).to(self.device)
            g_sigma[torch.from_numpy(local[ok])] = torch.from_numpy(global_sigma[ok]).to(self.device)
        has_global_t = torch.from_numpy(has_global).to(self.device)
        cluster_of = cluster_mu = cluster_sigma = None
        if cc.lambda_c > 0:  # FPPDM++: clusters from this round's starting distributions, fixed for the round
            mu0, sigma0 = self.user_distributions()
            cl = cluster_users(mu0, sigma0, cc, seed=self.seed + server_round)
            cluster_of = torch.from_numpy(cl.hard()).to(self.device)
            cluster_mu = torch.from_numpy(cl.mu).to(self.device)
            cluster_sigma = torch.from_numpy(cl.sigma).to(self.device)
        losses = []
        for _ in range(f.local_epochs):
            order = rng.permutation(d.users.size)
            for start in range(0, order.size, f.batch_size):
                idx = order[start : start + f.batch_size]
                users, pos = d.users[idx], d.items[idx]
                neg = sample_training_negatives(rng, d, users)
                gu = torch.from_numpy(users).to(self.device)  # the users' local ids (global-target tables)
                if rows:  # only the propagated rows of the batch's nodes (the same values and gradients)
                    nodes = np.unique(np.concatenate([users, pos + d.num_users, neg + d.num_users]))
                    mu, sigma = self.model.forward_rows(self.model.plan_rows(nodes))
                    u, p, q = (torch.from_numpy(np.searchsorted(nodes, a))
                               for a in (users, pos + d.num_users, neg + d.num_users))
                else:  # the reference: the whole graph every step
                    mu, sigma = self.model()
                    u = gu
                    p = torch.from_numpy(pos + d.num_users).to(self.device)
                    q = torch.from_numpy(neg + d.num_users).to(self.device)
                mu_u, sigma_u = mu[u], sigma[u]
                dp = w2_squared(mu_u, sigma_u, mu[p], sigma[p])
                dn = w2_squared(mu_u, sigma_u, mu[q], sigma[q])
                loss = torch.relu(f.margin + dp - dn).mean()
                if has_global.any():
                    w = has_global_t[gu].float()
                    loss = loss + f.lambda_p * (w * w2_squared(mu_u, sigma_u, g_mu[gu],
                                                               g_sigma[gu])).sum() / w.sum().clamp(min=1)
                if cluster_of is not None:
                    c = cluster_of[gu]
                    loss = loss + cc.lambda_c * w2_squared(mu_u, sigma_u, cluster_mu[c], cluster_sigma[c]).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return float(np.mean(losses)) if losses else 0.0

    @property
    def evaluation_seed(self) -> list[int]:
        """The seed of this domain's sampled negatives: the same ones at every evaluation."""
        return [self.seed, self.domain_index, 99]

    def evaluate(self, evaluation: FPPDMEvaluationConfig) -> dict[str, float]:
        """HR@K and NDCG@K of the current model on this domain's test users (see `ranking_metrics`)."""
        if self.data.test_users.size == 0:
            return {"n": 0}
        with torch.no_grad():
            mu, sigma = self.model()
        return ranking_metrics(self.data, mu.cpu().numpy(), sigma.cpu().numpy(), evaluation,
                               seed=self.evaluation_seed)


def positive_ranks(d: DomainData, mu: np.ndarray, sigma: np.ndarray, evaluation: FPPDMEvaluationConfig,
                   seed: list[int]) -> np.ndarray:
    """0-based rank of each test positive by -W2 against `evaluation.negatives` sampled non-interacted
    items (drawn from `seed`), in test-user order: what HR@K and NDCG@K are computed from.

    mu, sigma: the propagated distributions of the domain's users, then its items.
    """
    rng = np.random.default_rng(seed)
    candidates = np.empty((d.test_users.size, evaluation.negatives + 1), np.int64)
    for row, (u, item) in enumerate(zip(d.test_users, d.test_items)):
        candidates[row, 0] = item
        candidates[row, 1:] = sample_negatives(rng, d.num_items, d.positives[u] | {int(item)}, evaluation.negatives)
    um, us = mu[d.test_users][:, None, :], sigma[d.test_users][:, None, :]
    im, isg = mu[d.num_users + candidates], sigma[d.num_users + candidates]
    scores = -(((um - im) ** 2).sum(-1) + ((us - isg) ** 2).sum(-1))
    return rank_of_positive(scores[:, 0], scores[:, 1:])


def rank_metrics(ranks: np.ndarray, topk) -> dict[str, float]:
    """n and HR@K / NDCG@K for K in `topk` of a set of test positives' ranks."""
    out: dict[str, float] = {"n": int(ranks.size)}
    for k in topk:
        out[f"hr@{k}"] = hit_ratio_at_k(ranks, k)
        out[f"ndcg@{k}"] = ndcg_at_k(ranks, k)
    return out


def ranking_metrics(d: DomainData, mu: np.ndarray, sigma: np.ndarray, evaluation: FPPDMEvaluationConfig,
                    seed: list[int]) -> dict[str, float]:
    """HR@K and NDCG@K for K in `evaluation.topk` over the domain's test users (`positive_ranks`)."""
    if d.test_users.size == 0:
        return {"n": 0}
    return rank_metrics(positive_ranks(d, mu, sigma, evaluation, seed), evaluation.topk)
