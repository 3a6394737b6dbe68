"""Config resolution: presets, dataset files, overrides, and errors that name the key."""

import re

import pytest

from fedrec_flwr.config import ConfigError, from_run_config, load_config


def test_preset_carries_paper_hyperparameters():
    cfg = load_config("fedgnn_paper")
    assert (cfg.model.gnn, cfg.model.dim, cfg.model.dropout) == ("gat", 256, 0.2)
    assert (cfg.privacy.clip_delta, cfg.privacy.noise_lambda, cfg.privacy.pseudo_items) == (0.1, 0.2, 1000)
    assert cfg.federation.clients_per_round == 128 and cfg.server_opt.lr == 0.01
    assert cfg.expansion.epoch == 2


def test_dataset_file_and_overrides_merge_in_order():
    cfg = load_config("fedgnn_paper", "synthetic", ["model.gnn=gcn", "federation.rounds=3"])
    assert cfg.data.name == "synthetic" and cfg.data.synthetic.num_users == 300
    assert cfg.model.gnn == "gcn" and cfg.federation.rounds == 3


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="model.colour"):
        load_config("fedgnn_paper", None, ["model.colour=3"])


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="federation.rounds"):
        load_config("fedgnn_paper", None, ["federation.rounds=many"])


def test_bad_choice_is_named():
    with pytest.raises(ConfigError, match="model.gnn"):
        load_config("fedgnn_paper", None, ["model.gnn=transformer"])


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*fedgnn"):
        load_config("nope")


def test_an_old_or_unknown_key_or_preset_is_an_error_like_any_other():
    """The project keeps no aliases: a name that is not in the config is refused, named, with what exists."""
    with pytest.raises(ConfigError, match="unknown preset 'fedgnn'.*fedgnn_paper"):
        load_config("fedgnn")
    with pytest.raises(ConfigError, match=re.escape("invalid key 'fppdm.lr'")):
        load_config("fppdm", None, ["fppdm.lr=0.01"])
    assert load_config().preset == "fedgnn_paper" and load_config().algorithm == "fedgnn"


def test_flower_run_config_maps_to_app_config():
    cfg = from_run_config({"preset": "fedgnn_paper", "dataset": "synthetic", "data-dir": "/d", "output-dir": "/o",
                           "seed": 7, "set": "privacy.ldp=false federation.rounds=4"})
    assert (cfg.data.data_dir, cfg.output_dir, cfg.seed) == ("/d", "/o", 7)
    assert cfg.privacy.ldp is False and cfg.federation.rounds == 4
    with pytest.raises(ConfigError, match="unknown run-config key"):
        from_run_config({"preset": "fedgnn_paper", "colour": "red"})


def test_client_resources_and_device_come_from_config():
    import torch

    from fedrec_flwr.cli.runner import federation_config
    from fedrec_flwr.flower.client_app import client_device

    cfg = load_config("fedgnn_paper", "synthetic", ["simulation.num_gpus=0.25", "simulation.num_cpus=2"])
    assert federation_config(7, cfg) == "num-supernodes=7 client-resources-num-cpus=2 client-resources-num-gpus=0.25"
    assert client_device(load_config("fedgnn_paper", "synthetic")).type == "cpu"
    if torch.cuda.is_available():
        assert client_device(cfg).type == "cuda"
    else:
        assert client_device(cfg).type == "cpu"  # a GPU share on a machine without one falls back
        with pytest.raises(RuntimeError, match="simulation.device = 'cuda' but torch sees no CUDA device"):
            client_device(load_config("fedgnn_paper", "synthetic", ["simulation.device=cuda"]))


def test_fault_probabilities_are_checked():
    with pytest.raises(ConfigError, match="faults.crash.*probability"):
        load_config("fedgnn_paper", "synthetic", ["faults.crash=1.5"])
    with pytest.raises(ConfigError, match="checkpoint.resume does not support expansion.mode = 'trainable'"):
        load_config("fedgnn_paper", "synthetic", ["checkpoint.resume=true", "expansion.mode=trainable"])


@pytest.mark.parametrize("override, message", [
    ("server_opt.item_beta1=1.0", "'server_opt.item_beta1' = 1.0; expected 0 <= beta1 < 1"),
    ("server_opt.lr_decay=0", "'server_opt.lr_decay' = 0.0; expected 0 < decay <= 1"),
    ("server_opt.lr_decay=1.5", "'server_opt.lr_decay' = 1.5; expected 0 < decay <= 1"),
    ("server_opt.item_weight_decay=-1", "'server_opt.item_weight_decay' = -1.0; expected >= 0"),
    ("server_opt.item_weight_decay=100", "'server_opt.item_weight_decay' = 100.0; the item rate 0.01 times it "
                                         "must stay below 1"),
])
def test_server_optimiser_ranges_are_checked(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("fedgnn_paper", "synthetic", [override])


def test_a_preset_inherits_from_its_base_and_overrides_it():
    paper, tuned = load_config("fedgnn_paper"), load_config("fedgnn_tuned")
    assert tuned.preset == "fedgnn_tuned" and tuned.algorithm == "fedgnn"
    assert (tuned.privacy.pseudo_items, tuned.privacy.clip_delta, tuned.privacy.noise_lambda) == (1000, 0.1, 0.2)
    assert tuned.model.dim == paper.model.dim == 256 and tuned.federation.clients_per_round == 128
    assert (tuned.model.gnn, tuned.server_opt.name, tuned.local.batch_size) == ("ggnn", "adam", 1000)
    assert (paper.model.gnn, paper.server_opt.name) == ("gat", "sgd")  # the paper preset is untouched
    features = load_config("fedgnn_features", "ml-100k")
    assert features.data.item_features and not tuned.data.item_features and not paper.data.item_features
    assert (features.privacy.pseudo_items, features.privacy.clip_delta,
            features.privacy.noise_lambda) == (1000, 0.1, 0.2)
    assert (features.model.gnn, features.federation.rounds,
            features.federation.clients_per_round) == ("ggnn", 1000, 128)


def test_a_broken_preset_chain_is_named(tmp_path, monkeypatch):
    import fedrec_flwr.config as config

    (tmp_path / "a.yaml").write_text("base: b\n")
    (tmp_path / "b.yaml").write_text("base: a\n")
    (tmp_path / "c.yaml").write_text("base: nowhere\n")
    monkeypatch.setattr(config, "CONF_DIR", tmp_path)
    with pytest.raises(ConfigError, match=re.escape("presets inherit in a cycle: a -> b -> a")):
        load_config("a")
    with pytest.raises(ConfigError, match=r"conf/c.yaml, key 'base': unknown preset 'nowhere'"):
        load_config("c")


def test_a_preset_can_carry_settings_for_one_dataset():
    """conf/<preset>/<dataset>.yaml applies to that preset on that dataset only, under the overrides."""
    douban = load_config("fedgnn_tuned", "douban")
    assert (douban.federation.rounds, douban.local.user_steps, douban.server_opt.lr_decay) == (300, 5, 0.99)
    assert load_config("fedgnn_tuned", "ml-100k").federation.rounds == 700
    assert load_config("fedgnn_paper", "douban").federation.rounds == load_config("fedgnn_paper",
                                                                                  "ml-100k").federation.rounds
    assert load_config("fedgnn_tuned", "douban", ["federation.rounds=7"]).federation.rounds == 7


def test_each_fppdm_section_is_typed_and_overridable():
    cfg = load_config("fppdm_pp", None, ["fppdm.training.lr=0.02", "fppdm.model.dim=8", "fppdm.secure.enabled=true",
                                         "fppdm.server.max_abs_mu=5", "fppdm.evaluation.negatives=49"])
    f = cfg.fppdm
    assert (f.training.lr, f.model.dim, f.secure.enabled, f.server.max_abs_mu,
            f.evaluation.negatives) == (0.02, 8, True, 5.0, 49)
    assert (f.coclustering.lambda_c, f.coclustering.clusters, f.training.batch_size) == (0.07, 15, 256)
    assert load_config("single_domain").fppdm.server.aggregate is False
    assert load_config("fedavg_lightgcn").fppdm.model.gaussian is False
    with pytest.raises(ConfigError, match="fppdm.training.learning_rate"):
        load_config("fppdm", None, ["fppdm.training.learning_rate=0.1"])
    with pytest.raises(ConfigError, match=re.escape("'fppdm.coclustering.epsilon' = 0.0; expected > 0")):
        load_config("fppdm", None, ["fppdm.coclustering.epsilon=0"])


@pytest.mark.parametrize("dataset, rounds, eval_every, epochs, batch, lr", [
    ("douban-book-music", 12, 4, 1, 2048, 0.003),
    ("amazon-phone-elec", 6, 2, 1, 8192, 0.01),
    ("amazon-cloth-sport", 6, 2, 1, 8192, 0.01),
    ("disencdr:electronic_phone", 6, 2, 1, 8192, 0.01),  # a pair without a file of its own: its family's
    ("disencdr:sport_cloth", 6, 2, 1, 8192, 0.01),
])
def test_every_fppdm_preset_resolves_to_the_tables_settings_for_a_dataset(dataset, rounds, eval_every, epochs,
                                                                          batch, lr):
    """The dataset's settings files' `algorithms.fppdm` (family, then its own): what `fedrec run --preset P --dataset D`
    runs (no data read)."""
    for preset in ("single_domain", "fedavg_lightgcn", "fppdm", "fppdm_pp"):
        cfg = load_config(preset, dataset)
        t = cfg.fppdm.training
        assert (cfg.federation.rounds, cfg.federation.eval_every, t.local_epochs, t.batch_size, t.lr) == (
            rounds, eval_every, epochs, batch, lr), preset
    assert load_config("fppdm_pp", dataset).fppdm.coclustering.lambda_c == 0.07  # the preset's own keys stay
    assert load_config("single_domain", dataset).fppdm.training.lambda_p == 0.0
    assert load_config("fppdm", dataset, ["fppdm.training.lr=0.5"]).fppdm.training.lr == 0.5
    # FPPDM only
    assert load_config("fedgnn_paper", dataset).federation.rounds == load_config("fedgnn_paper").federation.rounds


def test_dataset_file_sections_per_algorithm_and_their_precedence(tmp_path, monkeypatch):
    """preset < conf/datasets/<d>.yaml (top level, then algorithms.<algorithm>) < conf/<preset>/<d>.yaml < --set."""
    import fedrec_flwr.config as config

    (tmp_path / "datasets").mkdir()
    (tmp_path / "p").mkdir()
    (tmp_path / "p.yaml").write_text("algorithm: fppdm\nfederation:\n  rounds: 1\n  eval_every: 1\n  min_clients: 1\n")
    (tmp_path / "q.yaml").write_text("algorithm: fedgnn\nfederation:\n  rounds: 1\n")
    (tmp_path / "datasets" / "d.yaml").write_text(
        "federation:\n  rounds: 2\n  eval_every: 2\n  min_clients: 2\n"
        "algorithms:\n  fppdm:\n    federation:\n      rounds: 3\n      eval_every: 3\n"
        "  fedgnn:\n    model:\n      dim: 4\n")
    (tmp_path / "p" / "d.yaml").write_text("federation:\n  rounds: 4\n")
    monkeypatch.setattr(config, "CONF_DIR", tmp_path)
    cfg = load_config("p", "d")
    assert (cfg.federation.min_clients, cfg.federation.eval_every, cfg.federation.rounds) == (2, 3, 4)
    assert load_config("p", "d", ["federation.rounds=5"]).federation.rounds == 5
    other = load_config("q", "d")
    assert (other.federation.rounds, other.federation.eval_every, other.model.dim) == (2, 2, 4)
    (tmp_path / "datasets" / "d.yaml").write_text("algorithms:\n  fppdm:\n    fppdm:\n      lr: 0.1\n")
    with pytest.raises(ConfigError, match=re.escape("section 'algorithms.fppdm': invalid key 'fppdm.lr'")):
        load_config("q", "d")  # every section is checked, not only the preset's own
    (tmp_path / "datasets" / "d.yaml").write_text("algorithms:\n  fppmd:\n    federation:\n      rounds: 3\n")
    with pytest.raises(ConfigError, match=r"datasets/d.yaml: key 'algorithms' maps algorithm names .*got \['fppmd'\]"):
        load_config("p", "d")
