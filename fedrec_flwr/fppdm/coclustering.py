"""Compactness co-clustering of users (FPPDM++), kept sparse so it runs on 10k+ users.

Three steps, alternated:
1. S: for each user, a distribution over its k nearest neighbours, the closed-form minimiser of
   sum_j s_ij d_ij + epsilon * sum_j s_ij log s_ij  (sum_j s_ij = 1):  s_ij = softmax_j(-d_ij / epsilon).
   S is a sparse users x k matrix: memory O(users * k).
2. F: the eigenvectors of the normalised Laplacian of (S + S^T)/2 for the M smallest eigenvalues
   (scipy's sparse eigensolver).
3. Entropy-regularised k-means on the rows of F: soft assignment q_ic = softmax_c(-||F_i - C_c||^2 / eta),
   centres C_c = weighted means.
Cluster Gaussians are the W2 barycenters of their members (assignment-weighted mean of mu and of sigma).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import eigsh

from fedrec_flwr.config import CoClusteringConfig


@dataclass
class Clusters:
    """Soft assignment [users, M] and the clusters' Gaussians [M, dim]."""

    assignment: np.ndarray
    mu: np.ndarray
    sigma: np.ndarray

    def hard(self) -> np.ndarray:
        """The most likely cluster of each user."""
        return self.assignment.argmax(1)


def _softmax_rows(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def knn_similarity(x: np.ndarray, k: int, epsilon: float, block: int = 2048) -> sp.csr_matrix:
    """Sparse S with s_ij = softmax over i's k nearest neighbours of -||x_i - x_j||^2 / epsilon (distances scaled to
    mean 1)."""
    n = x.shape[0]
    k = min(k, n - 1)
    sq = np.sum(x * x, 1)
    rows, cols, vals = [], [], []
    for start in range(0, n, block):  # blocks keep memory at O(block * n), never n x n
        d = sq[start:start + block, None] + sq[None, :] - 2 * x[start:start + block] @ x.T
        idx = np.arange(start, min(start + block, n))
        d[np.arange(idx.size), idx] = np.inf
        nn = np.argpartition(d, k - 1, axis=1)[:, :k]
        dist = np.take_along_axis(d, nn, 1)
        dist = np.maximum(dist, 0) / max(float(np.mean(dist[np.isfinite(dist)])), 1e-12)
        rows.append(np.repeat(idx, k))
        cols.append(nn.ravel())
        vals.append(_softmax_rows(-dist / epsilon).ravel())
    return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n))


def spectral_embedding(s: sp.csr_matrix, m: int, seed: int) -> np.ndarray:
    """Eigenvectors of I - D^-1/2 W D^-1/2, W = (S + S^T)/2, for the m smallest eigenvalues, rows normalised."""
    w = (s + s.T) * 0.5
    deg = np.asarray(w.sum(1)).ravel()
    inv = sp.diags(1.0 / np.sqrt(np.maximum(deg, 1e-12)))
    # the m largest eigenvalues of the normalised adjacency are the m smallest of the Laplacian
    a = inv @ w @ inv
    m = min(m, w.shape[0] - 2)
    v0 = np.random.default_rng(seed).random(w.shape[0])
    _, vecs = eigsh(a, k=m, which="LA", v0=v0)
    return vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)


def _entropic_kmeans_once(f: np.ndarray, clusters: int, eta: float, rng: np.random.Generator,
                          iters: int) -> tuple[np.ndarray, float]:
    n = f.shape[0]
    centres = [f[rng.integers(n)]]
    for _ in range(1, clusters):  # k-means++ seeding
        d = np.min([np.sum((f - c) ** 2, 1) for c in centres], axis=0)
        centres.append(f[rng.choice(n, p=d / d.sum()) if d.sum() > 0 else rng.integers(n)])
    c = np.stack(centres)
    for _ in range(iters):
        d = np.maximum(np.sum(f**2, 1)[:, None] + np.sum(c**2, 1)[None, :] - 2 * f @ c.T, 0)
        q = _softmax_rows(-d / eta)
        c = (q.T @ f) / np.maximum(q.sum(0)[:, None], 1e-12)
    objective = float(np.sum(q * d) + eta * np.sum(q * np.log(np.maximum(q, 1e-30))))
    return q, objective


def entropic_kmeans(f: np.ndarray, clusters: int, eta: float, seed: int, iters: int = 30,
                    restarts: int = 8) -> np.ndarray:
    """Soft assignments [n, clusters] of entropy-regularised k-means: best objective of several k-means++ starts."""
    rng = np.random.default_rng(seed)
    runs = [_entropic_kmeans_once(f, clusters, eta, rng, iters) for _ in range(restarts)]
    return min(runs, key=lambda r: r[1])[0]


def co_cluster(mu: np.ndarray, sigma: np.ndarray, clusters: int = 15, k: int = 10, epsilon: float = 0.05,
               eta: float = 0.1, seed: int = 0) -> Clusters:
    """Cluster users by their distributions and return soft assignments and cluster barycenters."""
    x = np.concatenate([mu, sigma], 1).astype(np.float64)
    s = knn_similarity(x, k, epsilon)
    f = spectral_embedding(s, clusters, seed)
    q = entropic_kmeans(f, clusters, eta, seed)
    weights = q / np.maximum(q.sum(0, keepdims=True), 1e-12)
    return Clusters(q.astype(np.float32), (weights.T @ mu).astype(np.float32), (weights.T @ sigma).astype(np.float32))


def cluster_users(mu: np.ndarray, sigma: np.ndarray, settings: CoClusteringConfig, seed: int) -> Clusters:
    """`co_cluster` with the `fppdm.coclustering` section's M, k, epsilon and eta."""
    return co_cluster(mu, sigma, settings.clusters, settings.knn, settings.epsilon, settings.eta, seed=seed)
