"""Typed run configuration: defaults <- conf/ preset <- conf/ dataset file <- overrides.

Every run (federated through `flwr run`, centralized, or a benchmark) resolves its
settings here, so an unknown key or a wrong type fails before any work starts, with
the offending key named.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A configuration key, value or file is invalid; the message names it."""


@dataclass
class SyntheticConfig:
    """Shape of the planted low-rank synthetic dataset."""

    num_users: int = 600
    num_items: int = 400
    rank: int = 4
    mean_degree: float = 40.0
    degree_exponent: float = 2.2
    noise_std: float = 0.25
    test_fraction: float = 0.1


@dataclass
class DataConfig:
    """Which dataset to load and where its files and cache live."""

    name: str = "synthetic"
    seed: int = 0  # synthetic generation and seeded splits; fixed across run seeds
    data_dir: str = "data"
    cache_dir: str = ".cache/fedrec"
    download: bool = False
    catalogue: str = ""  # deployment: the server reads dataset facts from this file, never the ratings
    # public item metadata as a FedGNN model input (ML-100K: u.item genres; synthetic: planted
    # genres). Not in the paper's model; a shared F x d weight maps it into item rows' space
    item_features: bool = False
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class ModelConfig:
    """GNN encoder of a star graph plus dot-product rating predictor."""

    gnn: str = "gat"
    dim: int = 256
    dropout: float = 0.2
    heads: int = 1
    biases: bool = False  # add b_u = v.x_u and b_i = w.x_i (shared v, w) to the dot product


@dataclass
class PrivacyConfig:
    """FedGNN upload protection: pseudo items and local differential privacy."""

    pseudo_items: int = 1000
    ldp: bool = True
    clip_delta: float = 0.1
    noise_lambda: float = 0.2


@dataclass
class FederationConfig:
    """Round structure of a federated run."""

    rounds: int = 30
    clients_per_round: int = 128
    min_clients: int = 2
    local_steps: int = 1
    batch_size: int = 64
    user_lr: float = 0.01
    user_steps: int = 1  # SGD steps on the private user embedding per round (>= 1)
    eval_every: int = 5
    # server side: subtract each upload's mean row before merging. Pseudo rows share the real
    # rows' mean, so unbiased pseudo rows would otherwise push every item of the anonymity set
    center_uploads: bool = False
    trivial_payload_floats: int = 16  # payload of the `trivial` baseline job, per client
    item_merge: str = "clients"  # "clients": divide by |S| (paper); "count": per-item count
    loss: str = "mean"  # uploaded gradients of the "mean" or "sum" of squared errors over the mini-batch
    round_timeout: float = 0.0  # seconds a round waits for replies (0: no limit); late clients count as failures
    min_nodes: int = 0  # FedGNN registration waits for this many SuperNodes (deployment: devices connect over time)
    node_wait_seconds: float = 300.0  # how long round 1 waits for the expected SuperNodes before failing
    eval_fraction: float = 1.0  # share of users (seeded sample) that evaluate; 1.0: every user


@dataclass
class SimulationConfig:
    """How a simulation maps users onto virtual SuperNodes and what each ClientApp may use."""

    users_per_node: int = 1  # users multiplexed per virtual SuperNode (deployment: always one node per user)
    num_cpus: float = 1.0  # Ray resources per ClientApp
    num_gpus: float = 0.0  # fractional GPU per ClientApp; > 0 moves models and batches to CUDA
    device: str = "auto"  # "auto": cuda when num_gpus > 0 and a GPU is visible, else cpu; or "cpu"/"cuda"


@dataclass
class FaultConfig:
    """Failure injection (off by default): per sampled node and training round, seeded."""

    crash: float = 0.0  # probability that the node's fit raises (client crash)
    straggle: float = 0.0  # probability that the node replies only after `straggle_seconds` (a timeout)
    straggle_seconds: float = 30.0
    malformed: float = 0.0  # probability that the node uploads NaN gradients (must be rejected)


@dataclass
class CheckpointConfig:
    """Server checkpoints every `every` training rounds (0: off); `resume` continues from `dir`."""

    every: int = 0
    dir: str = ""  # default: <output_dir>/checkpoint
    resume: bool = False


@dataclass
class ServerOptConfig:
    """Optimiser the strategy applies to the aggregated gradients."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    # learning rate of the item table (0: same as lr). Item rows are far noisier than the model's
    # gradients under LDP (each item's row averages few real uploads), so they want their own rate
    item_lr: float = 0.0
    # Adam's beta1 for the item table: a higher value averages each row's noisy merged gradient
    # over more rounds before it moves the row
    item_beta1: float = 0.9
    # both learning rates are multiplied by this after every training round (1.0: constant)
    lr_decay: float = 1.0
    # decoupled weight decay of the item table (AdamW style): every row shrinks by item rate x this
    # after each round. Rows of rarely rated items are mostly accumulated LDP noise; decay bounds it
    item_weight_decay: float = 0.0

    @property
    def item_rate(self) -> float:
        """The item table's starting learning rate: item_lr, or lr when item_lr is 0."""
        return self.item_lr or self.lr


@dataclass
class ExpansionConfig:
    """Privacy-preserving graph expansion with neighbour users."""

    mode: str = "none"
    epoch: int = 2  # T: expansion runs after T epochs (epoch = users / clients_per_round rounds)
    max_neighbours: int = 10  # N
    service_address: str = ""  # host:port of a running service; empty: start one on loopback
    retries: int = 3  # client retries when the service is unreachable


@dataclass
class CentralizedConfig:
    """Reference trainer with all data in one place."""

    epochs: int = 40
    lr: float = 0.001
    batch_users: int = 64
    weight_decay: float = 5e-4


@dataclass
class FPPDMConfig:
    """FPPDM / FPPDM++: per-domain Gaussian LightGCN, Wasserstein metric loss, barycenter server."""

    dim: int = 128
    layers: int = 3
    margin: float = 1.0
    lambda_p: float = 0.05  # weight of W2(local user, global user)
    lr: float = 0.001
    batch_size: int = 256
    local_epochs: int = 5
    negatives: int = 99  # sampled negatives per test user (leave-one-out ranking)
    topk: list[int] = field(default_factory=lambda: [5, 10])
    lambda_c: float = 0.0  # FPPDM++: weight of W2(user, its cluster); 0 disables co-clustering
    clusters: int = 15  # M: eigenvectors kept and clusters formed
    knn: int = 10  # neighbours per user in the sparse similarity S
    epsilon: float = 0.05  # entropy regulariser of S
    eta: float = 0.1  # entropy regulariser of the k-means assignment
    secure: bool = False  # Paillier secure aggregation of the users' (mu, sigma)
    key_file: str = ""  # the domains' shared Paillier key pair (JSON); never read by the server
    key_bits: int = 2048
    gaussian: bool = True  # false: point embeddings (sigma = 0, W2 becomes Euclidean): the LightGCN baseline
    aggregate: bool = True  # false: every domain trains alone (the single-domain baseline)
    shared_user_init: bool = False  # users start from a draw seeded by their global id in every domain


@dataclass
class AppConfig:
    """Everything a run needs, validated."""

    algorithm: str = "fedgnn"
    preset: str = "fedgnn"
    seed: int = 0
    output_dir: str = "outputs/latest"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    expansion: ExpansionConfig = field(default_factory=ExpansionConfig)
    centralized: CentralizedConfig = field(default_factory=CentralizedConfig)
    fppdm: FPPDMConfig = field(default_factory=FPPDMConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "algorithm": ("fedgnn", "trivial", "fppdm"),
    "model.gnn": ("gat", "gcn", "ggnn"),
    "federation.item_merge": ("clients", "count"),
    "federation.loss": ("mean", "sum"),
    "server_opt.name": ("sgd", "adam"),
    "expansion.mode": ("none", "fixed", "trainable"),
    "simulation.device": ("auto", "cpu", "cuda"),
}
_POSITIVE = (
    "model.dim",
    "model.heads",
    "federation.rounds",
    "federation.clients_per_round",
    "federation.local_steps",
    "federation.user_steps",
    "federation.batch_size",
    "federation.eval_every",
    "server_opt.lr",
    "centralized.epochs",
    "centralized.batch_users",
    "fppdm.dim",
    "fppdm.layers",
    "fppdm.lr",
    "fppdm.batch_size",
    "fppdm.local_epochs",
    "fppdm.negatives",
    "simulation.users_per_node",
)
_NON_NEGATIVE = (
    "privacy.pseudo_items", "privacy.clip_delta", "model.dropout", "expansion.max_neighbours",
    "federation.round_timeout", "simulation.num_cpus", "simulation.num_gpus", "faults.straggle_seconds",
    "checkpoint.every", "server_opt.item_lr", "server_opt.item_weight_decay",
)
_PROBABILITIES = ("faults.crash", "faults.straggle", "faults.malformed", "federation.eval_fraction")


def _preset_path(name: str) -> Path:
    return CONF_DIR / f"{name}.yaml"


def dataset_conf_path(name: str) -> Path:
    """conf/datasets/<name>.yaml, the per-dataset settings merged over a preset."""
    return CONF_DIR / "datasets" / f"{name}.yaml"


def _load_yaml(path: Path, what: str, known: list[str]):
    if not path.is_file():
        raise ConfigError(f"unknown {what} '{path.stem}': no file {path} (known: {', '.join(known)})")
    try:
        return OmegaConf.load(path)
    except Exception as exc:  # yaml errors carry line numbers
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


def available_presets() -> list[str]:
    """Names of the algorithm presets under conf/."""
    return sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def parse_overrides(text: str) -> list[str]:
    """Split a 'a.b=1 c=x' string (the run-config key `set`) into dotlist items."""
    items = shlex.split(text.replace(",", " "))
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
    return items


def _merge(base, layer, source: str):
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{source}: invalid key '{key}': {exc.msg if hasattr(exc, 'msg') else exc}") from exc


def _merge_preset(cfg, preset: str, chain: tuple[str, ...]):
    """Merge conf/<preset>.yaml into cfg, after the preset named by its `base:` key (if any)."""
    if preset in chain:
        raise ConfigError(f"conf/{preset}.yaml: presets inherit in a cycle: {' -> '.join([*chain, preset])}")
    layer = _load_yaml(_preset_path(preset), "preset", available_presets())
    base = layer.pop("base", None) if isinstance(layer, DictConfig) else None
    if base is not None:
        try:
            cfg = _merge_preset(cfg, str(base), (*chain, preset))
        except ConfigError as exc:
            raise ConfigError(f"conf/{preset}.yaml, key 'base': {exc}") from exc
    return _merge(cfg, layer, f"conf/{preset}.yaml")


def _validate(cfg: AppConfig) -> None:
    def get(path: str):
        value: Any = cfg
        for part in path.split("."):
            value = getattr(value, part)
        return value

    for key, choices in _CHOICES.items():
        if get(key) not in choices:
            raise ConfigError(f"config key '{key}' = {get(key)!r}; expected one of {choices}")
    for key in _POSITIVE:
        if not get(key) > 0:
            raise ConfigError(f"config key '{key}' = {get(key)!r}; expected a positive number")
    for key in _NON_NEGATIVE:
        if get(key) < 0:
            raise ConfigError(f"config key '{key}' = {get(key)!r}; expected >= 0")
    for key in _PROBABILITIES:
        if not 0.0 <= get(key) <= 1.0:
            raise ConfigError(f"config key '{key}' = {get(key)!r}; expected a probability in [0, 1]")
    if cfg.federation.eval_fraction == 0.0:
        raise ConfigError("config key 'federation.eval_fraction' must be > 0 (some users must evaluate)")
    if cfg.checkpoint.resume and cfg.expansion.mode == "trainable":
        raise ConfigError("checkpoint.resume does not support expansion.mode = 'trainable' (the neighbour "
                          "service's submissions are not checkpointed); use 'fixed' or 'none'")
    if cfg.privacy.ldp and cfg.privacy.noise_lambda <= 0:
        raise ConfigError("config key 'privacy.noise_lambda' must be > 0 when privacy.ldp is true")
    if not 0.0 <= cfg.server_opt.item_beta1 < 1.0:
        raise ConfigError(f"config key 'server_opt.item_beta1' = {cfg.server_opt.item_beta1}; expected 0 <= beta1 < 1")
    if not 0.0 < cfg.server_opt.lr_decay <= 1.0:
        raise ConfigError(f"config key 'server_opt.lr_decay' = {cfg.server_opt.lr_decay}; expected 0 < decay <= 1")
    item_rate = cfg.server_opt.item_rate
    if item_rate * cfg.server_opt.item_weight_decay >= 1.0:
        raise ConfigError(f"config key 'server_opt.item_weight_decay' = {cfg.server_opt.item_weight_decay}; the item "
                          f"rate {item_rate} times it must stay below 1 (each round scales rows by 1 - rate * decay)")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"config key 'model.dropout' = {cfg.model.dropout}; expected 0 <= dropout < 1")
    if cfg.federation.min_clients > cfg.federation.clients_per_round:
        raise ConfigError("config key 'federation.min_clients' exceeds 'federation.clients_per_round'")


def load_config(
    preset: str = "fedgnn",
    dataset: str | None = None,
    overrides: list[str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> AppConfig:
    """Resolve a preset, a dataset file and key=value overrides into a validated AppConfig.

    `extra` holds already-typed values (e.g. from Flower's run config) applied last.
    """
    cfg = _merge_preset(OmegaConf.structured(AppConfig), preset, ())
    cfg.preset = preset
    dataset = dataset or cfg.data.name  # no dataset given: the preset's own default
    if dataset:
        ds_path = dataset_conf_path(dataset)
        if ds_path.is_file():
            cfg = _merge(cfg, OmegaConf.load(ds_path), f"conf/datasets/{dataset}.yaml")
        cfg.data.name = dataset
    if overrides:
        try:
            layer = OmegaConf.from_dotlist(list(overrides))
        except Exception as exc:
            raise ConfigError(f"overrides {overrides}: {exc}") from exc
        cfg = _merge(cfg, layer, "override")
    if extra:
        cfg = _merge(cfg, OmegaConf.create(dict(extra)), "run config")
    typed: AppConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    _validate(typed)
    return typed


def from_run_config(run_config: Mapping[str, Any]) -> AppConfig:
    """Build the AppConfig from Flower's run config (pyproject [tool.flwr.app.config] + --run-config)."""
    known = {"preset", "dataset", "data-dir", "output-dir", "seed", "set", "cache-dir"}
    unknown = sorted(set(run_config) - known)
    if unknown:
        raise ConfigError(f"unknown run-config key(s) {unknown}; expected {sorted(known)}")
    extra: dict[str, Any] = {}
    if run_config.get("data-dir"):
        extra.setdefault("data", {})["data_dir"] = str(run_config["data-dir"])
    if run_config.get("cache-dir"):
        extra.setdefault("data", {})["cache_dir"] = str(run_config["cache-dir"])
    if run_config.get("output-dir"):
        extra["output_dir"] = str(run_config["output-dir"])
    if "seed" in run_config:
        extra["seed"] = int(run_config["seed"])
    overrides = parse_overrides(str(run_config.get("set", "")))
    dataset = str(run_config.get("dataset") or "") or None
    return load_config(str(run_config.get("preset", "fedgnn")), dataset, overrides, extra)


def to_dict(cfg: AppConfig) -> dict[str, Any]:
    """Plain-dict form of a config, for results files and for shipping to clients."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
