"""Typed run configuration: defaults <- conf/ preset <- conf/ dataset files <- overrides.

Every run (federated through `flwr run`, centralized, or a benchmark) resolves its
settings here, so an unknown key or a wrong type fails before any work starts, with
the offending key named.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Mapping, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedrec_flwr.algorithms import ALGORITHMS

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
    # the rating scale the planted ratings are put on: "1-5", "0.5-5" (half steps) or "1-100"
    # (the scales of the registry's datasets; fedrec_flwr.data.synthetic.SYNTHETIC_SCALES)
    scale: str = "1-5"


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
    init_std: float = 0.1  # std of the initial item rows (server) and user embeddings (devices)
    # a scalar rating offset per user, added to its predictions, trained on the device beside its
    # embedding and never uploaded (no privacy cost): what the user's own mean gives for free
    user_offset: bool = False
    # where that offset starts: "zero", or "mean": the user's own mean training rating minus the
    # model's starting global bias (the scale midpoint), so its first predictions are its own mean.
    # Computed on the device from its own ratings and never sent: no privacy cost
    user_offset_init: str = "zero"
    # a free scalar b_i per item, carried as one extra last column of the item's row (rows of width
    # dim + 1, `models.row_width`) and added to its predictions: uploaded, clipped, noised, imitated by
    # pseudo rows and merged with the rest of the row (the privacy accounting counts the extra coordinate)
    item_bias: bool = False


@dataclass
class PrivacyConfig:
    """FedGNN upload protection: pseudo items and local differential privacy."""

    pseudo_items: int = 1000  # M: the uniform sampler draws max(M, K) pseudo items for K own items
    # "uniform": pseudo items uniformly among the unrated items (the paper); "popularity": in every
    # popularity stratum `pseudo_ratio` pseudo items per own item, from a popularity the users report
    # under LDP before registration (fedrec_flwr.privacy.popularity)
    pseudo_sampler: str = "uniform"
    pseudo_ratio: int = 2
    popularity_bins: int = 64  # strata of equal size, by the reported popularity
    popularity_epsilon: float = 4.0  # LDP epsilon of each bit of a user's popularity report
    ldp: bool = True
    clip_delta: float = 0.1
    noise_lambda: float = 0.2
    delta: float = 1e-5  # the delta at which the accounted (epsilon, delta) budgets are reported


@dataclass
class FederationConfig:
    """Round structure of a federated run (FedGNN and FPPDM)."""

    rounds: int = 30
    clients_per_round: int = 128
    min_clients: int = 2  # a round with fewer accepted updates leaves the model unchanged
    eval_every: int = 5
    round_timeout: float = 0.0  # seconds a round waits for replies (0: no limit); late clients count as failures
    eval_fraction: float = 1.0  # share of users (seeded sample) that evaluate; 1.0: every user


@dataclass
class LocalTrainingConfig:
    """FedGNN on the device: what each sampled user computes before it protects its upload."""

    steps: int = 1  # mini-batch steps per round, averaged into one upload
    # "gradient": every step's gradient at the downloaded weights (the paper); "delta": the steps train a
    # local copy of the model and item rows by SGD at `lr` on gradients clipped to privacy.clip_delta, and
    # the upload is the whole local change over lr, clipped and noised as one upload (the same cost)
    upload: str = "gradient"
    lr: float = 0.001  # local SGD rate of the model and item rows ("delta" uploads)
    batch_size: int = 64
    loss: str = "mean"  # uploaded gradients of the "mean" or "sum" of squared errors over the mini-batch
    user_lr: float = 0.01  # SGD rate of the private user embedding
    user_steps: int = 1  # SGD steps on the private user embedding per round (>= 1; no privacy cost)


@dataclass
class MergeConfig:
    """FedGNN on the server: how the accepted uploads are bounded and combined."""

    items: str = "clients"  # item rows: "clients" divides by |S| (paper); "count" by the item's own count
    # subtract each upload's mean row before merging. Pseudo rows share the real rows' mean, so
    # unbiased pseudo rows would otherwise push every item of the anonymity set
    center_uploads: bool = False
    # "mean" (the paper's FedAvg), or coordinate-wise "median" or "trimmed" mean (dropping
    # trim_fraction of the values at each end), for model gradients and each item's rows
    robust: str = "mean"
    trim_fraction: float = 0.1
    # bound on the L2 norm of one user's upload (model gradients and item rows together) when
    # privacy.ldp is off (0: no bound). With LDP on the bound is the mechanism's own (fedgnn.bounds)
    upload_norm_bound: float = 0.0


@dataclass
class TrivialConfig:
    """The `trivial` overhead baseline."""

    payload_floats: int = 16  # floats each client echoes per round


@dataclass
class SimulationConfig:
    """How a simulation maps users onto virtual SuperNodes and what each ClientApp may use."""

    users_per_node: int = 1  # users multiplexed per virtual SuperNode (deployment: always one node per user)
    # FedGNN: how many of a node's sampled users compute their local steps as one batched computation
    # (fedrec_flwr.fedgnn.batched; the same numbers as one at a time, up to float rounding); 1: one at a time
    user_batch: int = 32
    num_cpus: float = 1.0  # Ray resources per ClientApp
    num_gpus: float = 0.0  # fractional GPU per ClientApp; > 0 moves models and batches to CUDA
    device: str = "auto"  # "auto": cuda when num_gpus > 0 and a GPU is visible, else cpu; or "cpu"/"cuda"
    # false: the ServerApp drops Flower's own INFO lines of every round and its end-of-run History dump
    # (fedrec_flwr.logs), leaving one `[fedgnn]` / `[fppdm]` line per round; true: show them (also in a deployment)
    flower_logs: bool = False


@dataclass
class DeploymentConfig:
    """A real federation: which authenticated SuperNode may speak for which user or domain."""

    # JSON file {node id: [user ids]} (FedGNN) or {node id: [domain index]} (FPPDM) written by the operator from the node ids that
    # `flwr supernode register --format json` printed; nodes not listed register nobody
    node_list: str = ""
    min_nodes: int = 0  # registration waits for this many SuperNodes (devices connect over time)
    node_wait_seconds: float = 300.0  # how long round 1 waits for the expected SuperNodes before failing


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
    # file holding the service's admin token (to open / close runs); empty: $FEDREC_NB_ADMIN_TOKEN.
    # Not the token itself: the run config also reaches every client
    service_token_file: str = ""
    ca_file: str = ""  # CA certificate the service's TLS certificate must chain to; empty: plain HTTP


@dataclass
class CentralizedConfig:
    """Reference trainer with all data in one place."""

    epochs: int = 40
    lr: float = 0.001
    batch_users: int = 64
    weight_decay: float = 5e-4


@dataclass
class FPPDMModelConfig:
    """A domain's model: LightGCN embeddings as diagonal Gaussians (or points), and how users start."""

    dim: int = 128  # D: size of every user's and item's mu (and sigma)
    layers: int = 3  # LightGCN propagation layers
    gaussian: bool = True  # false: point embeddings (sigma = 0, W2 becomes Euclidean): the LightGCN baseline
    shared_user_init: bool = False  # users start from a draw seeded by their global id in every domain


@dataclass
class FPPDMTrainingConfig:
    """A domain's local training each round: Adam on the W2 metric loss plus the pull to the global users."""

    lr: float = 0.001  # Adam's learning rate
    batch_size: int = 256  # training interactions per step (each step propagates the graph around them)
    local_epochs: int = 5  # passes over the domain's interactions per round
    margin: float = 1.0  # hinge margin between W2(user, positive) and W2(user, negative)
    lambda_p: float = 0.05  # weight of W2(local user, global user)
    # each step propagates only the graph rows its batch's users and items depend on, with scipy's CSR
    # kernels and a fused Adam (CPU; the same numbers up to float rounding); false: the whole graph every step
    row_propagation: bool = True


@dataclass
class CoClusteringConfig:
    """FPPDM++: compactness co-clustering of a domain's users, and the weight of its loss."""

    lambda_c: float = 0.0  # weight of W2(user, its cluster); 0 disables co-clustering (plain FPPDM)
    clusters: int = 15  # M: eigenvectors kept and clusters formed
    knn: int = 10  # neighbours per user in the sparse similarity S
    epsilon: float = 0.05  # entropy regulariser of S
    eta: float = 0.1  # entropy regulariser of the k-means assignment


@dataclass
class SecureAggregationConfig:
    """Paillier secure aggregation of the users' (mu, sigma): the server only multiplies ciphertexts."""

    enabled: bool = False
    key_file: str = ""  # the domains' shared Paillier key pair (JSON); never read by the server
    key_bits: int = 2048  # modulus size; the server checks ciphertext widths against it


@dataclass
class FPPDMEvaluationConfig:
    """Leave-one-out ranking of each domain's test users."""

    negatives: int = 99  # sampled non-interacted items ranked against each test positive
    topk: list[int] = field(default_factory=lambda: [5, 10])  # K of HR@K and NDCG@K


@dataclass
class FPPDMServerConfig:
    """What the server does with the domains' uploads: whether it aggregates, and which values it accepts."""

    aggregate: bool = True  # false: every domain trains alone (the single-domain baseline)
    # bounds on a domain's upload: |mu| <= max_abs_mu and sigma <= max_sigma (honest values are
    # O(1); the bounds stop a domain from dragging the barycenter arbitrarily far)
    max_abs_mu: float = 1000.0
    max_sigma: float = 1000.0


@dataclass
class FPPDMConfig:
    """FPPDM / FPPDM++: per-domain Gaussian LightGCN, Wasserstein metric loss, barycenter server."""

    model: FPPDMModelConfig = field(default_factory=FPPDMModelConfig)
    training: FPPDMTrainingConfig = field(default_factory=FPPDMTrainingConfig)
    coclustering: CoClusteringConfig = field(default_factory=CoClusteringConfig)
    secure: SecureAggregationConfig = field(default_factory=SecureAggregationConfig)
    evaluation: FPPDMEvaluationConfig = field(default_factory=FPPDMEvaluationConfig)
    server: FPPDMServerConfig = field(default_factory=FPPDMServerConfig)


# keys of the flat `fppdm` section and where they live now; an old key fails naming its new one
MOVED_KEYS: dict[str, str] = {
    **{f"fppdm.{k}": f"fppdm.model.{k}" for k in ("dim", "layers", "gaussian", "shared_user_init")},
    **{f"fppdm.{k}": f"fppdm.training.{k}" for k in ("lr", "batch_size", "local_epochs", "margin", "lambda_p")},
    **{f"fppdm.{k}": f"fppdm.coclustering.{k}" for k in ("lambda_c", "clusters", "knn", "epsilon", "eta")},
    "fppdm.secure": "fppdm.secure.enabled",
    **{f"fppdm.{k}": f"fppdm.secure.{k}" for k in ("key_file", "key_bits")},
    **{f"fppdm.{k}": f"fppdm.evaluation.{k}" for k in ("negatives", "topk")},
    **{f"fppdm.{k}": f"fppdm.server.{k}" for k in ("aggregate", "max_abs_mu", "max_sigma")},
}


# presets that were renamed, and their new names; an old name fails naming its new one
RENAMED_PRESETS: dict[str, str] = {
    "fedgnn": "fedgnn_paper",  # the paper's hyper-parameters; "fedgnn" is the algorithm, not a preset
}


@dataclass
class AppConfig:
    """Everything a run needs, validated."""

    algorithm: str = "fedgnn"
    preset: str = "fedgnn_paper"
    seed: int = 0
    output_dir: str = "outputs/latest"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    local: LocalTrainingConfig = field(default_factory=LocalTrainingConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    expansion: ExpansionConfig = field(default_factory=ExpansionConfig)
    centralized: CentralizedConfig = field(default_factory=CentralizedConfig)
    fppdm: FPPDMConfig = field(default_factory=FPPDMConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    trivial: TrivialConfig = field(default_factory=TrivialConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "algorithm": tuple(ALGORITHMS),
    "model.gnn": ("gat", "gcn", "ggnn"),
    "model.user_offset_init": ("zero", "mean"),
    "merge.items": ("clients", "count"),
    "local.loss": ("mean", "sum"),
    "local.upload": ("gradient", "delta"),
    "privacy.pseudo_sampler": ("uniform", "popularity"),
    "merge.robust": ("mean", "median", "trimmed"),
    "server_opt.name": ("sgd", "adam"),
    "expansion.mode": ("none", "fixed", "trainable"),
    "simulation.device": ("auto", "cpu", "cuda"),
    "data.synthetic.scale": ("1-5", "0.5-5", "1-100"),
}


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric key (a bound of None: unbounded), so every key is checked alike."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    text: str = ""  # the range in words for messages; default: built from the bounds

    def admits(self, value: float) -> bool:
        """True when `value` lies within the bounds."""
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def describe(self) -> str:
        """The range in words, for error messages."""
        low = None if self.low is None else f"{'>' if self.open_low else '>='} {self.low:g}"
        high = None if self.high is None else f"{'<' if self.open_high else '<='} {self.high:g}"
        return self.text or " and ".join(b for b in (low, high) if b) or "any number"


_ANY = Range(text="any integer")
_POSITIVE = Range(0, open_low=True)
_NON_NEGATIVE = Range(0)
_AT_LEAST_ONE = Range(1)
_PROBABILITY = Range(0, 1, text="a probability in [0, 1]")

# the range of every int, float and list-of-numbers key (a list: non-empty, each element in range).
# tests/test_config_validation.py fails when a numeric field of AppConfig is missing here
_RANGES: dict[str, Range] = {
    "seed": _ANY,
    "data.seed": _ANY,
    "data.synthetic.num_users": _AT_LEAST_ONE,
    "data.synthetic.num_items": Range(3),  # every synthetic user rates at least 3 distinct items
    "data.synthetic.rank": _AT_LEAST_ONE,
    "data.synthetic.mean_degree": _POSITIVE,
    "data.synthetic.degree_exponent": Range(1, open_low=True),  # the generator draws pareto(exponent - 1)
    "data.synthetic.noise_std": _NON_NEGATIVE,
    "data.synthetic.test_fraction": Range(0, 1, open_high=True, text="0 <= fraction < 1"),
    "model.init_std": _POSITIVE,
    "privacy.delta": Range(0, 1, open_low=True, open_high=True, text="0 < delta < 1"),
    "model.dim": _AT_LEAST_ONE,
    "model.dropout": Range(0, 1, open_high=True, text="0 <= dropout < 1"),
    "model.heads": _AT_LEAST_ONE,
    "privacy.pseudo_items": _NON_NEGATIVE,
    "privacy.pseudo_ratio": _AT_LEAST_ONE,
    "privacy.popularity_bins": _AT_LEAST_ONE,
    "privacy.popularity_epsilon": _POSITIVE,
    "privacy.clip_delta": _NON_NEGATIVE,
    "privacy.noise_lambda": _NON_NEGATIVE,  # and > 0 when privacy.ldp (checked in _validate)
    "federation.rounds": _AT_LEAST_ONE,
    "federation.clients_per_round": _AT_LEAST_ONE,
    "federation.min_clients": _AT_LEAST_ONE,  # and <= clients_per_round (checked in _validate)
    "local.steps": _AT_LEAST_ONE,
    "local.batch_size": _AT_LEAST_ONE,
    "local.user_lr": _POSITIVE,
    "local.lr": _POSITIVE,
    "local.user_steps": _AT_LEAST_ONE,
    "federation.eval_every": _AT_LEAST_ONE,
    "trivial.payload_floats": _AT_LEAST_ONE,
    "federation.round_timeout": _NON_NEGATIVE,  # 0: no limit
    "merge.upload_norm_bound": _NON_NEGATIVE,  # 0: no bound
    "merge.trim_fraction": Range(0, 0.5, open_high=True, text="0 <= fraction < 0.5"),
    "deployment.min_nodes": _NON_NEGATIVE,
    "deployment.node_wait_seconds": _NON_NEGATIVE,
    "federation.eval_fraction": Range(0, 1, open_low=True, text="0 < fraction <= 1 (some users must evaluate)"),
    "simulation.users_per_node": _AT_LEAST_ONE,
    "simulation.user_batch": _AT_LEAST_ONE,
    "simulation.num_cpus": _NON_NEGATIVE,
    "simulation.num_gpus": _NON_NEGATIVE,  # may exceed 1: several GPUs per ClientApp
    "faults.crash": _PROBABILITY,
    "faults.straggle": _PROBABILITY,
    "faults.straggle_seconds": _NON_NEGATIVE,
    "faults.malformed": _PROBABILITY,
    "checkpoint.every": _NON_NEGATIVE,  # 0: off
    "server_opt.lr": _POSITIVE,
    "server_opt.momentum": Range(0, 1, open_high=True, text="0 <= momentum < 1"),
    "server_opt.item_lr": _NON_NEGATIVE,  # 0: same as lr
    "server_opt.item_beta1": Range(0, 1, open_high=True, text="0 <= beta1 < 1"),
    "server_opt.lr_decay": Range(0, 1, open_low=True, text="0 < decay <= 1"),
    "server_opt.item_weight_decay": _NON_NEGATIVE,  # and item rate x it < 1 (checked in _validate)
    "expansion.epoch": _NON_NEGATIVE,  # 0: expand right after registration, before any training round
    "expansion.max_neighbours": _NON_NEGATIVE,
    "expansion.retries": _NON_NEGATIVE,
    "centralized.epochs": _AT_LEAST_ONE,
    "centralized.lr": _POSITIVE,
    "centralized.batch_users": _AT_LEAST_ONE,
    "centralized.weight_decay": _NON_NEGATIVE,
    "fppdm.model.dim": _AT_LEAST_ONE,
    "fppdm.model.layers": _AT_LEAST_ONE,
    "fppdm.training.lr": _POSITIVE,
    "fppdm.training.batch_size": _AT_LEAST_ONE,
    "fppdm.training.local_epochs": _AT_LEAST_ONE,
    "fppdm.training.margin": _POSITIVE,
    "fppdm.training.lambda_p": _NON_NEGATIVE,
    "fppdm.coclustering.lambda_c": _NON_NEGATIVE,  # 0 disables co-clustering
    "fppdm.coclustering.clusters": _AT_LEAST_ONE,
    "fppdm.coclustering.knn": _AT_LEAST_ONE,
    "fppdm.coclustering.epsilon": _POSITIVE,
    "fppdm.coclustering.eta": _POSITIVE,
    "fppdm.secure.key_bits": Range(512),  # shorter Paillier moduli are factored quickly
    "fppdm.evaluation.negatives": _AT_LEAST_ONE,
    "fppdm.evaluation.topk": _AT_LEAST_ONE,
    "fppdm.server.max_abs_mu": _POSITIVE,
    "fppdm.server.max_sigma": _POSITIVE,
}


def numeric_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Dotted names of all int, float and list-of-number keys, walked from the dataclasses so new keys get checked."""
    keys: list[str] = []
    for name, kind in get_type_hints(cls or AppConfig).items():
        if is_dataclass(kind):
            keys += numeric_keys(kind, f"{prefix}{name}.")
        elif kind in (int, float) or (get_origin(kind) is list and set(get_args(kind)) <= {int, float}):
            keys.append(prefix + name)
    return keys


def _preset_path(name: str) -> Path:
    return CONF_DIR / f"{name}.yaml"


def dataset_conf_path(name: str) -> Path:
    """conf/datasets/<name>.yaml, the per-dataset settings (optionally per algorithm) merged over a preset."""
    return CONF_DIR / "datasets" / f"{name}.yaml"


def preset_dataset_conf_path(preset: str, dataset: str) -> Path:
    """conf/<preset>/<dataset>.yaml: one preset's settings for one dataset, merged over conf/datasets/."""
    return CONF_DIR / preset / f"{dataset.replace(':', '_').replace('/', '_')}.yaml"


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
    """Split a 'a.b=1 c=x' string (the run-config key `set`) into dotlist items.

    Items may also be separated by commas (`a=1,b=2`); commas and spaces inside brackets or quotes
    stay, so list values such as `fppdm.topk=[5, 10]` arrive whole.
    """
    chars, depth, quote = [], 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif depth and ch.isspace():
            continue  # `[5, 10]` -> `[5,10]`: one shell word
        elif ch == "," and not depth:
            ch = " "
        chars.append(ch)
    try:
        items = shlex.split("".join(chars))
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"overrides {text!r}: {exc}") from None
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
    return items


_ABSENT = object()


def _moved_keys_in(layer) -> list[tuple[str, str]]:
    """(old, new) for every key of MOVED_KEYS that `layer` sets as a value (an old flat key, not a new section)."""
    data = OmegaConf.to_container(layer, resolve=False) if isinstance(layer, DictConfig) else {}
    found = []
    for old, new in MOVED_KEYS.items():
        value: Any = data
        for part in old.split("."):
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
        if value is not _ABSENT and not isinstance(value, dict):
            found.append((old, new))
    return found


def _refuse_moved(moved: list[tuple[str, str]], source: str) -> None:
    """ConfigError naming each moved key's new name, if there is any."""
    if len(moved) == 1:
        raise ConfigError(f"{source}: config key '{moved[0][0]}' has moved; use '{moved[0][1]}'")
    if moved:
        raise ConfigError(f"{source}: config keys have moved; use " + ", ".join(f"'{n}' for '{o}'" for o, n in moved))


def _merge(base, layer, source: str):
    _refuse_moved(_moved_keys_in(layer), source)
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(getattr(exc, "msg", exc)).splitlines()[0]  # the rest repeats the key and type names
        raise ConfigError(f"{source}: invalid key '{key}': {reason}") from exc


def _merge_preset(cfg, preset: str, chain: tuple[str, ...]):
    """Merge conf/<preset>.yaml into cfg, after the preset named by its `base:` key (if any).

    Returns the merged cfg and the presets merged, root base first (their dataset files apply in that order)."""
    if preset in chain:
        raise ConfigError(f"conf/{preset}.yaml: presets inherit in a cycle: {' -> '.join([*chain, preset])}")
    if preset in RENAMED_PRESETS and not _preset_path(preset).is_file():
        new = RENAMED_PRESETS[preset]
        raise ConfigError(f"preset '{preset}' has been renamed; use '{new}' (conf/{new}.yaml; '{preset}' "
                          f"names the algorithm, which a preset sets with its 'algorithm' key)")
    layer = _load_yaml(_preset_path(preset), "preset", available_presets())
    base = layer.pop("base", None) if isinstance(layer, DictConfig) else None
    lineage: list[str] = []
    if base is not None:
        try:
            cfg, lineage = _merge_preset(cfg, str(base), (*chain, preset))
        except ConfigError as exc:
            raise ConfigError(f"conf/{preset}.yaml, key 'base': {exc}") from exc
    return _merge(cfg, layer, f"conf/{preset}.yaml"), [*lineage, preset]


def _merge_dataset_file(cfg, path: Path):
    """Merge conf/datasets/<dataset>.yaml: its top-level keys, then its `algorithms.<cfg.algorithm>` section.

    `algorithms` maps an algorithm name to settings in the AppConfig layout that apply to every
    preset of that algorithm on this dataset; every section is checked, only the preset's own merged.
    """
    source = str(path.relative_to(CONF_DIR.parent))
    layer = _load_yaml(path, "settings file", [])
    sections = layer.pop("algorithms", None) if isinstance(layer, DictConfig) else None
    cfg = _merge(cfg, layer, source)
    if sections is None:
        return cfg
    unknown = sorted(set(sections) - set(ALGORITHMS)) if isinstance(sections, DictConfig) else [sections]
    if unknown:
        raise ConfigError(f"{source}: key 'algorithms' maps algorithm names {tuple(ALGORITHMS)} to settings; "
                          f"got {unknown}")
    merged = {name: _merge(cfg, section, f"{source}, section 'algorithms.{name}'") for name, section in sections.items()}
    return merged.get(cfg.algorithm, cfg)


def _get(cfg: AppConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _check_number(key: str, value: Any) -> None:
    """ConfigError naming `key` unless `value` (a number or a non-empty list of them) is finite and in range."""
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError(f"config key '{key}' = []; expected a non-empty list")
    rule = _RANGES.get(key, Range())
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"config key '{key}' = {value!r}; expected a finite number (not NaN or infinity)")
        if not rule.admits(v):
            what = f"every element {rule.describe()}" if isinstance(value, list) else rule.describe()
            raise ConfigError(f"config key '{key}' = {value!r}; expected {what}")


def _validate(cfg: AppConfig) -> None:
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"config key '{key}' = {_get(cfg, key)!r}; expected one of {choices}")
    for key in numeric_keys():
        _check_number(key, _get(cfg, key))
    if cfg.checkpoint.resume and cfg.expansion.mode == "trainable":
        raise ConfigError("checkpoint.resume does not support expansion.mode = 'trainable' (the neighbour "
                          "service's submissions are not checkpointed); use 'fixed' or 'none'")
    if cfg.model.user_offset_init != "zero" and not cfg.model.user_offset:
        raise ConfigError(f"config key 'model.user_offset_init' = {cfg.model.user_offset_init!r} needs "
                          "model.user_offset = true (there is no private offset to start otherwise)")
    if cfg.privacy.ldp and cfg.privacy.noise_lambda <= 0:
        raise ConfigError("config key 'privacy.noise_lambda' must be > 0 when privacy.ldp is true")
    item_rate = cfg.server_opt.item_rate
    if item_rate * cfg.server_opt.item_weight_decay >= 1.0:
        raise ConfigError(f"config key 'server_opt.item_weight_decay' = {cfg.server_opt.item_weight_decay}; the item "
                          f"rate {item_rate} times it must stay below 1 (each round scales rows by 1 - rate * decay)")
    if cfg.federation.min_clients > cfg.federation.clients_per_round:
        raise ConfigError(f"config key 'federation.min_clients' = {cfg.federation.min_clients}; expected <= "
                          f"federation.clients_per_round ({cfg.federation.clients_per_round})")


def load_config(
    preset: str = "fedgnn_paper",
    dataset: str | None = None,
    overrides: list[str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> AppConfig:
    """Resolve a preset, a dataset file and key=value overrides into a validated AppConfig.

    Later layers win: preset (after its `base:`) < conf/datasets/<dataset>.yaml (its top-level keys,
    then its section for the preset's algorithm) < conf/<base>/<dataset>.yaml for each preset it inherits
    from, root first < conf/<preset>/<dataset>.yaml < overrides <
    `extra`, already-typed values (e.g. from Flower's run config).
    """
    cfg, lineage = _merge_preset(OmegaConf.structured(AppConfig), preset, ())
    cfg.preset = preset
    dataset = dataset or cfg.data.name  # no dataset given: the preset's own default
    if dataset:
        if dataset_conf_path(dataset).is_file():
            cfg = _merge_dataset_file(cfg, dataset_conf_path(dataset))
        for name in lineage:  # a preset inherits its bases' dataset settings, its own win
            path = preset_dataset_conf_path(name, dataset)
            if path.is_file():
                cfg = _merge(cfg, _load_yaml(path, "settings file", []), str(path.relative_to(CONF_DIR.parent)))
        cfg.data.name = dataset
    if overrides:
        layer = OmegaConf.create()
        for item in overrides:
            key = item.split("=", 1)[0].strip()
            _refuse_moved([(key, MOVED_KEYS[key])] if key in MOVED_KEYS else [], "override")
            try:
                layer.merge_with_dotlist([item])
            except Exception as exc:
                raise ConfigError(f"override '{item}': {' '.join(str(exc).split())}") from exc
        cfg = _merge(cfg, layer, "override")
    if extra:
        cfg = _merge(cfg, OmegaConf.create(dict(extra)), "run config")
    typed: AppConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    _validate(typed)
    return typed


def _run_config_int(run_config: Mapping[str, Any], key: str) -> int:
    value = run_config[key]
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"run-config key '{key}' = {value!r}; expected an integer") from None


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
        extra["seed"] = _run_config_int(run_config, "seed")
    try:
        overrides = parse_overrides(str(run_config.get("set", "")))
    except ConfigError as exc:
        raise ConfigError(f"run-config key 'set': {exc}") from None
    dataset = str(run_config.get("dataset") or "") or None
    return load_config(str(run_config.get("preset", "fedgnn_paper")), dataset, overrides, extra)


def to_dict(cfg: AppConfig) -> dict[str, Any]:
    """Plain-dict form of a config, for results files and for shipping to clients."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
