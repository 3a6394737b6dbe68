"""Centralized reference: the FedGNN model trained with all ratings in one place, no privacy.

It gives the accuracy ceiling and the speed reference for the federated runs: same model,
same split, same metrics. Like the federated model it trains in reference units (ratings mapped
onto [1, 5] by the public scale, `RatingScale.to_units`) and reports metrics on the dataset's scale.
With model.item_bias its item rows carry the bias b_i as a last column, as the federated table's do.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from fedrec_flwr.config import AppConfig, to_dict
from fedrec_flwr.data import RatingDataset, load_from_config
from fedrec_flwr.metrics import mae, rmse
from fedrec_flwr.models.rating_gnn import build_model, row_width
from fedrec_flwr.models.star_graph import build_star_batch
from fedrec_flwr.reporting.results import RunRecorder

log = logging.getLogger(__name__)


def _by_user(num_users: int, users: np.ndarray, items: np.ndarray, values: np.ndarray):
    order = np.argsort(users, kind="stable")
    bounds = np.searchsorted(users[order], np.arange(num_users + 1))
    return [(items[order[bounds[u]:bounds[u + 1]]], values[order[bounds[u]:bounds[u + 1]]]) for u in range(num_users)]


class CentralizedTrainer:
    """Full-batch-of-users trainer of user/item embeddings and the star-graph GNN."""

    def __init__(self, cfg: AppConfig, ds: RatingDataset):
        self.cfg, self.ds = cfg, ds
        torch.manual_seed(cfg.seed)
        self.rng = np.random.default_rng(cfg.seed)
        d = cfg.model.dim
        self.units = ds.scale.in_units()  # what the model trains on, as FedGNN's devices do
        self.model = build_model(cfg.model, self.units.midpoint,
                                 0 if ds.item_features is None else ds.item_features.shape[1])
        self.features = None if ds.item_features is None else torch.from_numpy(ds.item_features)
        self.user_emb = torch.nn.Parameter(torch.randn(ds.num_users, d) * 0.1)
        items = torch.randn(ds.num_items, d) * 0.1
        if row_width(cfg.model) > d:  # model.item_bias: each item's row carries its bias b_i last, from 0
            items = torch.cat([items, torch.zeros(ds.num_items, row_width(cfg.model) - d)], 1)
        self.item_emb = torch.nn.Parameter(items)
        params = [*self.model.parameters(), self.user_emb, self.item_emb]
        self.opt = torch.optim.Adam(params, lr=cfg.centralized.lr, weight_decay=cfg.centralized.weight_decay)
        self.train = _by_user(ds.num_users, ds.train.users, ds.train.items, ds.scale.to_units(ds.train.values))
        self.test = _by_user(ds.num_users, ds.test.users, ds.test.items, ds.scale.to_units(ds.test.values))

    def _forward(self, users: np.ndarray, with_query: bool):
        tr = [self.train[u] for u in users]
        te = [self.test[u] for u in users] if with_query else None
        batch = build_star_batch([len(i) for i, _ in tr], [len(i) for i, _ in te] if te else None)
        train_items = torch.from_numpy(np.concatenate([i for i, _ in tr]))
        query_items = torch.from_numpy(np.concatenate([i for i, _ in te])) if te else None
        pred_t, pred_q = self.model(
            batch, self.user_emb[torch.from_numpy(users)], self._item_input(train_items),
            self._item_input(query_items) if query_items is not None else None,
        )
        return pred_t, pred_q, tr, te

    def _item_input(self, items: torch.Tensor) -> torch.Tensor:
        return self.model.item_input(self.item_emb[items], None if self.features is None else self.features[items])

    def train_epoch(self) -> float:
        """One pass over all users in shuffled batches; returns the mean training loss."""
        self.model.train()
        users = self.rng.permutation(self.ds.num_users)
        losses = []
        for start in range(0, users.size, self.cfg.centralized.batch_users):
            chunk = users[start:start + self.cfg.centralized.batch_users]
            chunk = chunk[[len(self.train[u][0]) > 0 for u in chunk]]
            if chunk.size == 0:
                continue
            pred, _, tr, _ = self._forward(chunk, with_query=False)
            target = torch.from_numpy(np.concatenate([v for _, v in tr]))
            loss = torch.mean((pred - target) ** 2)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            losses.append(loss.item())
        return float(np.mean(losses))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Test RMSE and MAE over every test rating (users without training ratings too), predictions clipped to
        the rating scale, on the dataset's scale; with the count scored beside the split's."""
        self.model.eval()
        preds, targets = [], []
        users = np.flatnonzero([len(i) > 0 for i, _ in self.test])
        for start in range(0, users.size, 256):
            chunk = users[start:start + 256]
            _, pred_q, _, te = self._forward(chunk, with_query=True)
            preds.append(pred_q.numpy())
            targets.append(np.concatenate([v for _, v in te]))
        p, t = np.concatenate(preds), np.concatenate(targets)
        s, factor = self.units, self.ds.scale.unit_factor  # errors in reference units, reported on the dataset's scale
        return {"rmse": rmse(p, t, s.low, s.high) * factor, "mae": mae(p, t, s.low, s.high) * factor,
                "eval_ratings": int(t.size), "test_ratings": len(self.ds.test)}


def run_centralized(cfg: AppConfig) -> dict:
    """Train the centralized reference, write results.json, and return the final metrics."""
    t0 = time.time()
    ds = load_from_config(cfg.data)
    if not isinstance(ds, RatingDataset):
        raise ValueError(f"dataset '{cfg.data.name}' is multi-domain; the FedGNN centralized reference needs ratings")
    trainer = CentralizedTrainer(cfg, ds)
    rec = RunRecorder(cfg.output_dir, f"{cfg.algorithm}-centralized", ds.name, to_dict(cfg))
    best: dict[str, float] = {}
    for epoch in range(1, cfg.centralized.epochs + 1):
        te = time.time()
        loss = trainer.train_epoch()
        metrics = trainer.evaluate()
        rec.add_round({"round": epoch, "train_loss": loss, **metrics, "round_seconds": time.time() - te,
                       "bytes_up": 0, "bytes_down": 0})
        print(f"[centralized] epoch {epoch:3d} loss {loss:.4f} rmse {metrics['rmse']:.4f} mae {metrics['mae']:.4f}",
              flush=True)
        best = metrics
    global_mean = float(ds.train.values.mean())
    baseline = rmse(np.full(len(ds.test), global_mean), ds.test.values, ds.scale.low, ds.scale.high)
    final = {**best, "global_mean_rmse": baseline}
    rec.finish(final, {"wall_seconds_total": time.time() - t0})
    return final
