"""The centralized reference learns: it beats the global-mean predictor clearly on synthetic data."""

import json

from fedrec_flwr.config import load_config
from fedrec_flwr.reference.centralized import run_centralized


def test_centralized_beats_global_mean(tmp_path):
    cfg = load_config("fedgnn_paper", "synthetic", [
        f"output_dir={tmp_path}", f"data.cache_dir={tmp_path / 'c'}", "model.dim=32", "centralized.epochs=12",
        "centralized.lr=0.01",
    ])
    final = run_centralized(cfg)
    assert final["rmse"] < 0.9 * final["global_mean_rmse"], final
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["dataset"] == "synthetic" and len(doc["rounds"]) == 12 and doc["final"]["rmse"] == final["rmse"]
    assert doc["config"]["model"]["dim"] == 32 and doc["wall_seconds"] > 0


def test_the_centralized_reference_scores_every_test_rating_cold_users_and_items_too(tmp_path):
    """A user with test ratings only, and an item rated in the test split only: both scored."""
    import numpy as np

    from fedrec_flwr.data import RatingDataset, Ratings, RatingScale
    from fedrec_flwr.reference.centralized import CentralizedTrainer

    rng = np.random.default_rng(0)
    users, items = np.repeat(np.arange(20), 6), rng.integers(0, 30, 120)
    keys = np.unique(users * 30 + items)
    users, items = keys // 30, keys % 30
    values = rng.integers(1, 6, users.size).astype(np.float32)
    test = np.arange(users.size) % 5 == 0
    # user 20, item 30
    cold = Ratings(np.array([20, 20, 3]), np.array([1, 2, 30]), np.array([4.0, 2.0, 5.0], np.float32))
    ds = RatingDataset("tiny", 21, 31, RatingScale(1.0, 5.0, 1.0), Ratings(users[~test], items[~test], values[~test]),
                       Ratings(np.r_[users[test], cold.users], np.r_[items[test], cold.items],
                               np.r_[values[test], cold.values]))
    cfg = load_config("fedgnn_paper", "synthetic", [f"output_dir={tmp_path}", "model.dim=8"])
    out = CentralizedTrainer(cfg, ds).evaluate()
    assert out["eval_ratings"] == out["test_ratings"] == len(ds.test) and np.isfinite(out["rmse"])


def test_baselines_are_scored_on_the_same_users_as_a_sampled_evaluation():
    """With federation.eval_fraction < 1 the model is scored on a sample of users: its baselines then are too."""
    import numpy as np

    from fedrec_flwr.data import RatingDataset, Ratings, RatingScale
    from fedrec_flwr.reference.baselines import baseline_rmses, baselines_on_users

    train = Ratings(np.array([0, 0, 1, 1, 2]), np.array([0, 1, 0, 1, 0]),
                    np.array([5.0, 4.0, 1.0, 2.0, 3.0], np.float32))
    test = Ratings(np.array([0, 1, 2]), np.array([2, 2, 1]), np.array([5.0, 1.0, 3.0], np.float32))
    ds = RatingDataset("tiny", 3, 3, RatingScale(1.0, 5.0, 1.0), train, test)
    rmses, scored = baselines_on_users(ds, [0])
    assert scored == 1 and rmses["user_mean"] == np.float64(0.5)  # user 0's mean 4.5 against its 5.0
    assert baseline_rmses(ds) != rmses and baselines_on_users(ds, [0, 1, 2]) == (baseline_rmses(ds), 3)
