"""One FedGNN preset on every rating scale of the registry (1-5, 0.5-5 in half steps, 1-100).

FedGNN trains in reference units: ratings are mapped onto [1, 5] by the public scale where a device
reads them, and metrics are mapped back where the server reports them (`RatingScale.to_units`). The
synthetic generator puts the same planted ratings on each scale (`data.synthetic.scale`), so a
scale-invariant protocol should land at the same RMSE / (high - low) on all three.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.config import ConfigError, load_config
from fedrec_flwr.data import RatingScale, UserPartitions, prepare_partitions, public_scale
from fedrec_flwr.data.node_files import load_catalogue, load_user_file
from fedrec_flwr.data.synthetic import make_synthetic
from fedrec_flwr.deployment.node_data import export_nodes
from fedrec_flwr.privacy.device_secret import DeviceSecret
from fedrec_flwr.reference.baselines import baseline_rmses
from tests.conftest import TEST_SECRET, fixed_secrets

SCALES = ("1-5", "0.5-5", "1-100")
# 20 rounds of 32 of 120 users (each trained ~5 times), evaluated once: about 8 s a scale on one core
SMALL = ["data.synthetic.num_users=120", "federation.rounds=20", "federation.eval_every=20",
         "federation.clients_per_round=32"]


def _cfg(tmp_path, scale: str, *extra: str):
    return load_config("quickstart", None, [f"data.cache_dir={tmp_path}", f"data.synthetic.scale={scale}",
                                           f"simulation.device_secrets={fixed_secrets(tmp_path)}", *extra])


def test_the_map_is_the_identity_on_1_to_5_and_inverts_elsewhere():
    one_five = RatingScale(1.0, 5.0, 1.0)
    v = np.array([1.0, 2.0, 5.0], np.float32)
    assert one_five.to_units(v) is v and one_five.in_units() is one_five and one_five.unit_factor == 1.0
    for s in (RatingScale(0.5, 5.0, 0.5), RatingScale(1.0, 100.0, 1.0)):
        raw = np.arange(s.low, s.high + s.step / 2, s.step, dtype=np.float32)
        units = s.to_units(raw)
        assert units.dtype == np.float32 and units.min() == pytest.approx(1.0) and units.max() == pytest.approx(5.0)
        np.testing.assert_allclose(s.from_units(units), raw, rtol=1e-6)
        assert s.in_units() == RatingScale(1.0, 5.0, s.step * 4 / (s.high - s.low))


def test_synthetic_scales_share_the_planted_structure():
    base = make_synthetic(num_users=80, num_items=60)
    assert np.array_equal(base.train.values, make_synthetic(num_users=80, num_items=60, scale="1-5").train.values)
    for name in ("0.5-5", "1-100"):
        ds = make_synthetic(num_users=80, num_items=60, scale=name)
        assert np.array_equal(ds.train.users, base.train.users) and np.array_equal(ds.test.items, base.test.items)
        steps = (ds.train.values - ds.scale.low) / ds.scale.step
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)  # on the scale's grid
        # the same ratings up to the rounding to each scale's step
        assert np.corrcoef(ds.scale.to_units(ds.train.values), base.train.values)[0, 1] > 0.9
    with pytest.raises(ConfigError, match="data.synthetic.scale"):
        load_config("quickstart", None, ["data.synthetic.scale=1-10"])


def test_devices_read_reference_units_and_stores_keep_the_dataset_scale(tmp_path):
    cfg = _cfg(tmp_path, "1-100", "data.synthetic.num_users=40")
    parts = UserPartitions(prepare_partitions(cfg.data))
    want = RatingScale(1.0, 100.0, 1.0)
    assert parts.meta.scale == want.in_units() and parts.meta.dataset_scale == want == public_scale(cfg.data)
    assert parts.ratings().scale == want and parts.ratings().train.values.max() > 5  # baselines: the dataset's own
    user = parts.user(3)
    assert 1.0 <= user.train_values.min() and user.train_values.max() <= 5.0
    np.testing.assert_array_equal(user.train_values, want.to_units(parts.stored_user(3).train_values))
    cat = export_nodes(cfg, tmp_path / "nodes", users=[3])
    meta, data = load_user_file(tmp_path / "nodes" / "user-3.npz")  # deployment: the same view as simulation
    assert meta == parts.meta and np.array_equal(data.test_values, user.test_values)
    assert load_catalogue(cat)["meta"] == parts.meta
    assert '"high": 100.0' in cat.read_text()  # the catalogue publishes the dataset's scale


SECOND_SECRET = DeviceSecret(bytes([7]) * 32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(final RMSE, global-mean RMSE, high - low) of the small quickstart protocol on each scale, the RMSE the mean of
    two runs with different fixed device secrets (one 20-round run's draws move its ratio by about 0.01)."""
    out = {}
    for scale in SCALES:
        rmses = []
        for secret in (TEST_SECRET, SECOND_SECRET):
            folder = tmp_path_factory.mktemp(scale)
            path = folder / "secret"
            path.write_text(secret.hex_for_node_state())
            path.chmod(0o600)
            cfg = _cfg(folder, scale, *SMALL, f"simulation.device_secrets={path}")
            rmses.append(run_in_process(cfg, log_every=0)["rmse"])
        ds = UserPartitions(prepare_partitions(cfg.data)).ratings()
        out[scale] = (float(np.mean(rmses)), baseline_rmses(ds)["global_mean"], ds.scale.span)
    return out


def test_rmse_over_the_range_agrees_across_scales(runs):
    """The data's own rounding makes the scales differ: the global-mean predictor's RMSE / range spreads 0.013
    (0.2449, 0.2328, 0.2319), the 1-5 integers being the coarsest, and the model's ratio to it comes out highest on
    1-5 too. Measured (20 rounds, device-secret draws): the ratio's spread is 0.016 to 0.030 over four single
    secrets, 0.023 for the mean of the two used here. Without the map back, 1-100 would report RMSE / range near
    0.002; without the device-side map the ratio spread 0.035 (seeded draws; the map itself is tested directly
    above). Tolerances: 0.025 on RMSE / range, 0.03 on the ratio to the global-mean RMSE (the scale-free number)."""
    normalised = {s: rmse / span for s, (rmse, _, span) in runs.items()}
    ratio = {s: rmse / mean for s, (rmse, mean, _) in runs.items()}
    assert max(normalised.values()) - min(normalised.values()) < 0.025, normalised
    assert max(ratio.values()) - min(ratio.values()) < 0.03, ratio


def test_every_scale_beats_its_global_mean(runs):
    """Measured: 0.886, 0.884, 0.875 of the global-mean RMSE after 20 rounds."""
    for scale, (rmse, mean, _) in runs.items():
        assert rmse < 0.95 * mean, (scale, rmse, mean)
