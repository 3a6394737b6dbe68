"""FPPDM's fast training path (`fppdm.training.row_propagation`, on by default) computes what the whole-graph
reference computes: the same propagated rows, the same gradients, the same trained parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedrec_flwr.config import load_config
from fedrec_flwr.data.synthetic import make_synthetic_multidomain
from fedrec_flwr.fppdm.domain import DomainData, DomainTrainer
from fedrec_flwr.models.gaussian_gcn import GaussianLightGCN, RowPlan, normalised_adjacency


def _model(seed: int = 0, users: int = 30, items: int = 50, layers: int = 3) -> GaussianLightGCN:
    rng = np.random.default_rng(seed)
    u = rng.integers(0, users, 200)
    i = rng.integers(0, items - 5, 200)  # the last items have no interaction: isolated nodes
    keys = np.unique(u * items + i)
    torch.manual_seed(seed)
    return GaussianLightGCN(users, items, 8, layers, normalised_adjacency(users, items, keys // items, keys % items))


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("full_fraction", [0.7, 0.0, 1.0])  # as used; every set widened to all nodes; never widened
def test_row_plan_gives_the_full_propagations_rows_and_gradients(layers, full_fraction):
    model = _model(layers=layers)
    n = model.num_users + model.num_items
    rows = np.unique(np.r_[[0, 3, 7], model.num_users + np.array([1, 2, 40, 47])])  # 47: an isolated item
    weights = torch.randn(rows.size, 8, generator=torch.Generator().manual_seed(1))

    mu, sigma = model()
    (weights * mu[rows]).sum().backward()
    (weights * sigma[rows]).sum().backward()
    ref_rows = (mu[rows].detach(), sigma[rows].detach())
    ref_grads = (model.mu.grad.clone(), model.sigma_raw.grad.clone())
    model.zero_grad()

    plan = RowPlan(model.plan_rows(rows).blocks[0], layers, rows, full_fraction=full_fraction)
    mu_b, sigma_b = model.forward_rows(plan)
    (weights * mu_b).sum().backward()
    (weights * sigma_b).sum().backward()
    # one propagation and its backward, summed in another order: float32 reassociation over the <= 200 terms of a
    # row gives at most n u = 200 * 6e-8 ~ 1e-5 of the row's scale (see the bound above the training test)
    for got, want in ((mu_b, ref_rows[0]), (sigma_b, ref_rows[1])):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert model.mu.grad.shape == (n, 8)
    for got, want in ((model.mu.grad, ref_grads[0]), (model.sigma_raw.grad, ref_grads[1])):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _train(row_propagation: bool, extra: list[str], threads: int = 1,
           fused_adam: bool = True) -> tuple[list[float], dict[str, np.ndarray]]:
    cfg = load_config("fppdm", "synthetic-md3", ["fppdm.model.dim=16", "fppdm.training.local_epochs=2",
                                                  "fppdm.training.batch_size=64", "fppdm.training.lr=0.01",
                                                  f"fppdm.training.row_propagation={str(row_propagation).lower()}",
                                                  *extra])
    f = cfg.fppdm
    trainer = DomainTrainer(DomainData(make_synthetic_multidomain(seed=0).domains[1]), 1, f.model, f.training,
                            f.coclustering, cfg.seed)
    trainer.fused_adam = fused_adam
    ids = trainer.data.global_ids[::2]  # half the users have a global target (lambda_P term)
    rng = np.random.default_rng(3)
    g_mu = rng.normal(size=(ids.size, 16)).astype(np.float32)
    g_sigma = rng.uniform(0.5, 1.5, (ids.size, 16)).astype(np.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        losses = [trainer.train(r, ids, g_mu, g_sigma) for r in (1, 2)]
    finally:
        torch.set_num_threads(before)
    return losses, trainer.state()


CASES = [
    ([], 1),
    ([], 2),  # mu and sigma propagated on two threads
    (["fppdm.coclustering.lambda_c=1.0", "fppdm.coclustering.clusters=4"], 1),  # FPPDM++
    (["fppdm.model.gaussian=false"], 1),  # point embeddings (the LightGCN baseline)
    (["fppdm.model.layers=1", "fppdm.model.shared_user_init=true"], 1),
]


# Two code paths that sum in different orders (row propagation against the whole graph; fused Adam against
# torch's default kernels) agree only up to float32 rounding, not bitwise. The bound: float32's unit roundoff
# is u = 2**-24 = 6e-8, and a propagated row or a batch loss sums at most a few hundred terms, so one step's
# values differ by at most about n u = 1e-5 relative. Adam's normalised step m / sqrt(v) passes a relative
# difference through unchanged, except on a coordinate whose gradient is itself near zero, where it can move
# a step of up to lr. So after the ~80 Adam steps compared here, losses agree to 1e-5 relative, 99.9% of the
# entries of every table to 1e-5 of its scale, and the rare near-zero-gradient entries to 1e-4 of it.
LOSS_RTOL, BULK, WORST, BULK_SHARE = 1e-5, 1e-5, 1e-4, 0.999


@pytest.mark.parametrize("fused_adam", [False, True])
@pytest.mark.parametrize("extra, threads", CASES)
def test_row_propagation_trains_the_same_parameters_as_the_whole_graph_reference(extra, threads, fused_adam):
    """Two rounds of two epochs (about 80 Adam steps) from the same seed: the fast path's losses and every
    trained table equal the reference's (the whole graph propagated every step, torch's default Adam) within
    the float32 tolerance above, with the reference's Adam kernels and with the fused one it uses by default."""
    ref_losses, ref = _train(False, extra)
    losses, got = _train(True, extra, threads, fused_adam=fused_adam)
    assert np.allclose(losses, ref_losses, rtol=LOSS_RTOL, atol=0)
    assert ref.keys() == got.keys()
    for key in ref:
        scale = max(float(np.abs(ref[key]).max()), 1e-6)
        diff = np.abs(got[key] - ref[key])
        assert diff.max() <= WORST * scale, (key, diff.max() / scale)
        assert np.mean(diff <= BULK * scale + 1e-7) >= BULK_SHARE, key
