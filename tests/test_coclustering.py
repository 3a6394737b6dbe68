"""FPPDM++ co-clustering: planted groups are recovered; S stays sparse; cluster Gaussians are barycenters."""

import numpy as np

from fedrec_flwr.fppdm.coclustering import co_cluster, knn_similarity


def _blobs(n_per=60, groups=3, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 5, (groups, dim))
    labels = np.repeat(np.arange(groups), n_per)
    mu = centres[labels] + rng.normal(0, 0.3, (labels.size, dim))
    sigma = np.abs(rng.normal(1, 0.05, (labels.size, dim)))
    return mu, sigma, labels


def test_similarity_is_sparse_row_stochastic_knn():
    mu, sigma, _ = _blobs()
    s = knn_similarity(np.concatenate([mu, sigma], 1), k=7, epsilon=0.05)
    assert s.nnz == mu.shape[0] * 7  # O(users * k) memory
    assert np.allclose(np.asarray(s.sum(1)).ravel(), 1.0)
    assert s.diagonal().sum() == 0  # a user is not its own neighbour


def test_planted_groups_are_recovered():
    mu, sigma, labels = _blobs()
    cl = co_cluster(mu, sigma, clusters=3, k=10, epsilon=0.05, eta=0.1, seed=0)
    hard = cl.hard()
    # purity: each found cluster is (almost) one planted group
    purity = sum(np.bincount(labels[hard == c]).max() for c in np.unique(hard)) / labels.size
    assert purity > 0.95 and np.unique(hard).size == 3
    assert np.allclose(cl.assignment.sum(1), 1.0, atol=1e-5)


def test_cluster_gaussians_are_assignment_weighted_barycenters():
    mu, sigma, _ = _blobs()
    cl = co_cluster(mu, sigma, clusters=3, seed=1)
    w = cl.assignment / cl.assignment.sum(0, keepdims=True)
    assert np.allclose(cl.mu, w.T @ mu, atol=1e-4) and np.allclose(cl.sigma, w.T @ sigma, atol=1e-4)
