"""Deployment data: each SuperNode's own file, the server's rating-free catalogue, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import RecordDict
from flwr.common import Context

from fedrec_flwr.config import load_config
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.data.node_files import NodeDataError, load_catalogue, load_domain_file, load_user_file
from fedrec_flwr.deployment.node_data import export_nodes
from fedrec_flwr.flower.client_app import client_fn


def test_user_files_round_trip_and_catalogue_holds_no_ratings(tiny_cfg, tmp_path):
    cfg = tiny_cfg()
    cat_path = export_nodes(cfg, tmp_path / "nodes", users=[3, 7])
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta, data = load_user_file(tmp_path / "nodes" / "user-7.npz")
    want = parts.user(7)
    assert data.user == 7 and meta == parts.meta
    for a, b in ((data.train_items, want.train_items), (data.train_values, want.train_values),
                 (data.test_items, want.test_items), (data.test_values, want.test_values)):
        np.testing.assert_array_equal(a, b)
    assert sorted(p.name for p in (tmp_path / "nodes").iterdir()) == ["catalogue.json", "user-3.npz", "user-7.npz"]
    raw = json.loads(cat_path.read_text())
    assert set(raw) == {"algorithm", "dataset", "num_users", "num_items", "scale", "num_train", "num_test",
                        "fingerprint", "num_item_features"}
    assert load_catalogue(cat_path)["meta"] == parts.meta


def test_domain_files_round_trip(tmp_path):
    cfg = load_config("fppdm", "synthetic-md3", [f"data.cache_dir={tmp_path / 'cache'}"])
    export_nodes(cfg, tmp_path / "nodes")
    index, dom = load_domain_file(tmp_path / "nodes" / "domain-2.npz")
    assert index == 2 and dom.name == "domain2" and dom.train_users.size > 0
    assert load_catalogue(tmp_path / "nodes" / "catalogue.json")["domains"] == ["domain0", "domain1", "domain2"]


def test_a_deployed_node_hosts_exactly_the_user_of_its_file(tiny_cfg, tmp_path):
    cfg = tiny_cfg()
    export_nodes(cfg, tmp_path / "nodes", users=[11])
    run_config = {"preset": "fedgnn_paper", "dataset": "synthetic", "cache-dir": cfg.data.cache_dir,
                  "set": "data.synthetic.num_users=60 data.synthetic.num_items=80 data.synthetic.mean_degree=12 "
                         "model.dim=16 privacy.pseudo_items=30"}
    node_config = {"data-path": str(tmp_path / "nodes" / "user-11.npz")}
    with pytest.raises(ValueError, match="needs a state-dir"):  # its secret and committed set must outlive a run
        client_fn(Context(run_id=1, node_id=99, node_config=node_config, state=RecordDict(), run_config=run_config))
    node_config["state-dir"] = str(tmp_path / "device")
    ctx = Context(run_id=1, node_id=99, node_config=node_config, state=RecordDict(), run_config=run_config)
    client = client_fn(ctx)
    reply = client.numpy_client.fit([], {"phase": "register", "round": 1})
    assert reply[0][0].tolist() == [11] and reply[1] == 1


@pytest.mark.parametrize("content, reason", [
    (None, "no such file"),
    (b"not a zip", "not a readable .npz"),
])
def test_bad_node_files_name_the_file(tmp_path, content, reason):
    path = tmp_path / "user-1.npz"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(NodeDataError, match=f"{path}.*{reason}"):
        load_user_file(path)


def test_a_user_file_without_ratings_is_refused(tmp_path):
    path = tmp_path / "user-1.npz"
    np.savez(path, user=np.int64(1))
    with pytest.raises(NodeDataError, match="missing arrays .*train_items"):
        load_user_file(path)
    with pytest.raises(NodeDataError, match="no such file"):
        load_catalogue(tmp_path / "catalogue.json")
