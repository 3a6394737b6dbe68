"""Public item features (data.item_features): loading, alignment, the model input, and the protocol."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedrec_flwr.cli.inprocess import run_in_process
from fedrec_flwr.data import DataError, UserPartitions, prepare_partitions
from fedrec_flwr.data.node_files import NodeDataError, load_user_file
from fedrec_flwr.data.sources import load_dataset
from fedrec_flwr.deployment.node_data import export_nodes
from fedrec_flwr.fedgnn.local_step import train_users
from fedrec_flwr.fedgnn.server import FedGNNServer
from fedrec_flwr.fedgnn.user import DeviceSections, FedGNNUser, MemoryStore
from fedrec_flwr.models.rating_gnn import RatingGNN
from fedrec_flwr.models.star_graph import build_star_batch


def _item_line(item: int, genres: list[int]) -> str:
    flags = ["1" if g in genres else "0" for g in range(19)]
    return "|".join([str(item), f"Movie {item} (1995)", "01-Jan-1995", "", "http://example.org", *flags])


def _ml100k_fixture(root, items_lines: list[str]):
    d = root / "ml-100k"
    d.mkdir(parents=True)
    (d / "u1.base").write_text("1\t3\t4\t0\n1\t10\t2\t0\n2\t7\t5\t0\n2\t3\t3\t0\n")
    (d / "u1.test").write_text("1\t7\t3\t0\n2\t10\t1\t0\n")
    (d / "u.item").write_text("\n".join(items_lines) + "\n", encoding="latin-1")
    return root


def test_movielens_genres_are_aligned_to_the_compacted_item_ids(tmp_path):
    lines = [_item_line(i, [i % 19]) for i in range(1, 12)]
    lines[6] = _item_line(7, [0, 5, 8])  # three genres: each gets 1/3
    lines[9] = _item_line(10, [])  # no genre: a zero row, not a division by zero
    root = _ml100k_fixture(tmp_path, lines)
    ds = load_dataset("ml-100k", root, tmp_path / "cache", item_features=True)
    assert ds.meta["raw_item_ids"].tolist() == [3, 7, 10] and ds.item_features.shape == (3, 19)
    want = np.zeros((3, 19), np.float32)
    want[0, 3] = 1.0
    want[1, [0, 5, 8]] = 1.0 / 3.0
    np.testing.assert_allclose(ds.item_features, want, rtol=1e-6)
    assert load_dataset("ml-100k", root, tmp_path / "cache").item_features is None  # only when asked for


@pytest.mark.parametrize("lines, message", [
    ([_item_line(3, [1]), _item_line(7, [2])], "no line for 1 rated item(s), e.g. id 10"),
    ([_item_line(3, [1]), "7|short line", _item_line(10, [2])], "u.item:2: expected 24 '|'-separated fields"),
    ([_item_line(3, [1]), _item_line(7, [2]).replace("|1", "|2"), _item_line(10, [2])],
     "u.item:2: genre flags must be 0 or 1"),
])
def test_a_bad_item_catalogue_is_refused_naming_the_file_and_line(tmp_path, lines, message):
    root = _ml100k_fixture(tmp_path, lines)
    with pytest.raises(DataError, match="u.item") as err:
        load_dataset("ml-100k", root, tmp_path / "cache", item_features=True)
    assert message in str(err.value)


def test_asking_for_features_a_dataset_does_not_have_is_an_error(tmp_path):
    with pytest.raises(DataError, match="data.item_features = true, but dataset 'synthetic-md2' has no "
                                        "public item features"):
        load_dataset("synthetic-md2", tmp_path, tmp_path / "cache", item_features=True)
    root = _ml100k_fixture(tmp_path, [])
    (root / "ml-100k" / "u.item").unlink()
    with pytest.raises(DataError, match=r"missing 1 file\(s\):\n  put ml-100k/u.item at .*downloadable"):
        load_dataset("ml-100k", root, tmp_path / "cache", item_features=True)


def test_the_feature_map_starts_as_the_paper_model_and_learns_from_the_loss():
    torch.manual_seed(0)
    plain = RatingGNN("ggnn", 8, biases=True, bias_init=3.0)
    with_features = RatingGNN("ggnn", 8, biases=True, bias_init=3.0, num_item_features=5)
    with_features.load_state_dict({**plain.state_dict(), "item_feature_map": with_features.item_feature_map.detach()})
    batch = build_star_batch([4], [2])
    user, items, query = torch.randn(1, 8), torch.randn(4, 8, requires_grad=True), torch.randn(2, 8)
    feats, qfeats = torch.rand(4, 5), torch.rand(2, 5)
    want = plain(batch, user, items, query)
    got = with_features(batch, user, with_features.item_input(items, feats), with_features.item_input(query, qfeats))
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b)
    loss = ((got[0] - torch.tensor([1.0, 5.0, 2.0, 4.0])) ** 2).sum()
    g_map, g_rows = torch.autograd.grad(loss, [with_features.item_feature_map, items])
    assert g_map.abs().sum() > 0
    (g_plain,) = torch.autograd.grad(((want[0] - torch.tensor([1.0, 5.0, 2.0, 4.0])) ** 2).sum(), [items])
    torch.testing.assert_close(g_rows, g_plain)  # the item rows' gradient (what is uploaded) is the same function
    with pytest.raises(ValueError, match="takes public item features"):
        with_features.item_input(items, None)


def test_features_flow_through_partitions_and_are_learned_under_ldp(tiny_cfg):
    cfg = tiny_cfg("data.item_features=true", "federation.rounds=6", "federation.eval_every=3",
                   "server_opt.name=adam", "server_opt.lr=0.01", "federation.clients_per_round=20")
    parts = UserPartitions(prepare_partitions(cfg.data))
    assert parts.meta.num_item_features == 8 and parts.item_features.shape == (80, 8)
    assert parts.user(5).item_features is parts.item_features  # one shared public array, not a copy per user
    plain = UserPartitions(prepare_partitions(tiny_cfg().data))
    np.testing.assert_array_equal(plain.user(5).train_values, parts.user(5).train_values)  # same ratings
    assert plain.meta.num_item_features == 0 and plain.meta.fingerprint != parts.meta.fingerprint

    seen = {}

    def probe(server, rmse, device_user):
        seen["map"] = server.model.item_feature_map.detach().clone()
        return {}

    out = run_in_process(cfg, log_every=0, probe=probe)
    assert np.isfinite(out["rmse"]) and seen["map"].abs().max() > 0

    # the feature map's gradient is part of the model upload: clipped like every other coordinate
    cfg_tight = tiny_cfg("data.item_features=true", "privacy.noise_lambda=1e-9")
    server = FedGNNServer.from_config(cfg_tight, parts.meta.num_items, parts.meta.scale.midpoint, num_item_features=8)
    user = FedGNNUser(DeviceSections.from_config(cfg_tight), parts.meta, parts.user(5), MemoryStore())
    server.register(5, user.register())
    upload = train_users([user], server.model_weights(), [server.rows_for(5)], 2)[0]
    assert len(upload) == len(server.model_weights()) + 2
    names = [n for n, _ in server.model.named_parameters()]
    assert upload[names.index("item_feature_map")].shape == (8, 16)  # the map's gradient is uploaded
    assert all(np.abs(a).max() <= cfg_tight.privacy.clip_delta + 1e-6 for a in upload[:-2] + upload[-1:])
    server.validate(5, upload)  # the server's shape checks include the map


def test_deployed_user_files_carry_the_public_features(tiny_cfg, tmp_path):
    cfg = tiny_cfg("data.item_features=true")
    export_nodes(cfg, tmp_path / "nodes", users=[4])
    meta, data = load_user_file(tmp_path / "nodes" / "user-4.npz")
    parts = UserPartitions(prepare_partitions(cfg.data))
    assert meta.num_item_features == 8
    np.testing.assert_array_equal(data.item_features, parts.item_features)
    with np.load(tmp_path / "nodes" / "user-4.npz") as z:
        arrays = {k: z[k] for k in z.files if k != "item_features"}
    np.savez(tmp_path / "user-4.npz", **arrays)
    with pytest.raises(NodeDataError, match=r"user-4.npz: item_features none, expected shape \(80, 8\)"):
        load_user_file(tmp_path / "user-4.npz")


def test_centralized_trainer_uses_the_features(tiny_cfg):
    from fedrec_flwr.data import load_from_config
    from fedrec_flwr.reference.centralized import CentralizedTrainer

    cfg = tiny_cfg("data.item_features=true")
    trainer = CentralizedTrainer(cfg, load_from_config(cfg.data))
    trainer.train_epoch()
    assert trainer.model.item_feature_map.abs().max() > 0 and np.isfinite(trainer.evaluate()["rmse"])
