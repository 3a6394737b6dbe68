"""Typed run configuration: defaults <- conf/ preset <- conf/ dataset files <- overrides.

Every run (federated through `flwr run`, centralized, or a benchmark) resolves its
settings here, so an unknown key or a wrong type fails before any work starts, with
the offending key named.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedrec_flwr.algorithms import ALGORITHMS
from fedrec_flwr.data.sources import dataset_family
from fedrec_flwr.privacy_modes import PRIVACY_MODES, privacy_mode

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A configuration key, value or file is invalid; the message names it."""


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

def ranged(default: Any, rule: "Range") -> Any:
    """A numeric config field with its allowed values, declared beside it (checked by `load_config`)."""
    return field(default=default, metadata={"range": rule})


def ranged_list(factory: Any, rule: "Range") -> Any:
    """A list-of-numbers config field: non-empty, each element within `rule`."""
    return field(default_factory=factory, metadata={"range": rule})


@dataclass
class SyntheticConfig:
    """Shape of the planted low-rank synthetic dataset."""

    num_users: int = ranged(600, _AT_LEAST_ONE)
    num_items: int = ranged(400, Range(3))  # every synthetic user rates at least 3 distinct items
    rank: int = ranged(4, _AT_LEAST_ONE)
    mean_degree: float = ranged(40.0, _POSITIVE)
    degree_exponent: float = ranged(2.2, Range(1, open_low=True))  # the generator draws pareto(exponent - 1)
    noise_std: float = ranged(0.25, _NON_NEGATIVE)
    test_fraction: float = ranged(0.1, Range(0, 1, open_high=True, text="0 <= fraction < 1"))
    # the rating scale the planted ratings are put on: "1-5", "0.5-5" (half steps) or "1-100"
    # (the scales of the registry's datasets; fedrec_flwr.data.synthetic.SYNTHETIC_SCALES)
    scale: str = "1-5"


@dataclass
class DataConfig:
    """Which dataset to load and where its files and cache live."""

    name: str = "synthetic"
    seed: int = ranged(0, _ANY)  # synthetic generation and seeded splits; fixed across run seeds
    data_dir: str = "data"
    cache_dir: str = ".cache/fedrec"
    download: bool = False
    catalogue: str = ""  # deployment: the server reads dataset facts from this file, never the ratings
    # public item metadata as a FedGNN model input (ML-100K: u.item genres; synthetic: planted
    # genres). Not in the paper's model; a shared F x d weight maps it into item rows' space
    item_features: bool = False
    # which ratings a run is scored on: "test" (the split's test set), or "validation": a per-user
    # validation_fraction of the training ratings, held out of training (data.holdout), for choosing a
    # schedule without reading the test set (FedGNN and the centralized reference; rating datasets only)
    holdout: str = "test"
    validation_fraction: float = ranged(0.1, Range(0, 1, open_low=True, open_high=True, text="0 < fraction < 1"))
    # a sparse or cold variant of a rating dataset (fedrec_flwr.data.sparse): the training ratings a user keeps on
    # average (0: all of them), and the share of the users with test ratings that keep none (cold users); the test
    # ratings stay, so every variant is scored on the same ratings
    train_per_user: float = ranged(0.0, _NON_NEGATIVE)
    cold_fraction: float = ranged(0.0, Range(0, 1, open_high=True, text="0 <= fraction < 1"))
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class ModelConfig:
    """GNN encoder of a star graph plus dot-product rating predictor."""

    gnn: str = "gat"
    dim: int = ranged(256, _AT_LEAST_ONE)
    dropout: float = ranged(0.2, Range(0, 1, open_high=True, text="0 <= dropout < 1"))
    heads: int = ranged(1, _AT_LEAST_ONE)
    biases: bool = False  # add b_u = v.x_u and b_i = w.x_i (shared v, w) to the dot product
    init_std: float = ranged(0.1, _POSITIVE)  # std of the initial item rows (server) and user embeddings (devices)
    # a scalar rating offset per user, added to its predictions, trained on the device beside its
    # embedding and never uploaded (no privacy cost): what the user's own mean gives for free
    user_offset: bool = False
    # where that offset starts: "zero", or "mean": the user's own mean training rating minus the
    # model's starting global bias (the scale midpoint), so its first predictions are its own mean.
    # Computed on the device from its own ratings and never sent: no privacy cost
    user_offset_init: str = "zero"
    # shrinkage of that offset towards 0 (the prediction without it), in pseudo-ratings k: the local loss adds
    # k / n * offset^2 (n the user's training ratings), so the offset settles at sum(residuals) / (n + k), the bias
    # model's regularised user bias. A user with 3 ratings keeps 3 / (3 + k) of its mean residual, one with 300
    # nearly all: the few ratings of a light user no longer set its whole prediction. 0: no shrinkage
    user_offset_reg: float = ranged(0.0, _NON_NEGATIVE)
    # b_pop: a second global bias, of the population part alone (the global bias and the items' own terms t_i: w.x_i,
    # b_i; `models.dense_star.population_predict`), trained on each user's mean (b_pop + t_i - r)^2, never in the full
    # prediction. The full model's b cannot serve: the users' free terms (offset, embedding) soak up the data's mean
    # and leave b near the scale's midpoint, so b + t_i, all a cold user (no rating) can be given, would miss the
    # mean. One more model weight, uploaded and protected as the others
    population_bias: bool = False
    # k: a user with n training ratings predicts the population part (global bias and the items' own terms) plus its
    # own part (dot product, user bias, offset) times n / (n + k), the bias model's shrinkage of a user bias: a user
    # with 3 ratings trusts what 3 ratings taught its private embedding that much. On the device, at prediction only:
    # no privacy cost. 0: the full prediction. A cold user (no rating, no neighbour) predicts the population part
    personal_shrink: float = ranged(0.0, _NON_NEGATIVE)
    # lambda: the population loss (b_pop + t_i - r)^2, the error of a user of whom nothing is known, also trains the
    # items' own terms t_i (w.x_i, b_i; with data.item_features the feature map too) at this weight beside the full
    # loss. The full loss alone does not say where an item's mean belongs: the users' dot products can carry it
    # (every private embedding learning one shared direction), and a cold or light user, who is given b_pop + t_i,
    # then loses it. Under user-level DP inside the clipped update, so sigma and epsilon are unchanged; the paper's
    # LDP refuses it (`fedgnn.modes.ldp.check_config`): it would add a direction to the real rows that the pseudo
    # rows fitted to them do not imitate (the audit's AUC rose from 0.53 to 0.66). 0: t_i trains on the full loss only
    population_item_weight: float = ranged(0.0, Range(0, 100))
    # a free scalar b_i per item, carried as one extra last column of the item's row (rows of width
    # dim + 1, `models.row_width`) and added to its predictions: uploaded, clipped, noised, imitated by
    # pseudo rows and merged with the rest of the row (the privacy accounting counts the extra coordinate)
    item_bias: bool = False


@dataclass
class PrivacyConfig:
    """FedGNN upload protection: the paper's pseudo items and local DP ("ldp"), or user-level DP on the sum of the
    sampled users' clipped updates under secure aggregation ("user_dp", fedrec_flwr.fedgnn.user_dp)."""

    # "ldp": the paper's mechanism (anonymity sets of pseudo items; with `ldp`, every coordinate clipped and
    # Laplace-noised). "user_dp": each user samples itself with probability clients_per_round / users, clips its
    # whole update (model and item-table gradient) to L2 norm clip_norm and adds its share of Gaussian noise;
    # the server sees only the SecAgg+ sum of all users' vectors (the pseudo-item and ldp keys are unused)
    mode: str = "ldp"
    clip_norm: float = ranged(1.0, _POSITIVE)  # user_dp: C, the L2 bound of one user's whole update
    # user_dp: sigma, the noise on the sum has standard deviation sigma * C; 0: calibrated from target_epsilon
    noise_multiplier: float = ranged(0.0, _NON_NEGATIVE)
    # user_dp: the user-level epsilon (at `delta`) a run may spend; training stops before it would exceed it
    # (0: no limit, with noise_multiplier > 0)
    target_epsilon: float = ranged(8.0, _NON_NEGATIVE)
    # user_dp: SecAgg+ key shares per node as a fraction of the nodes (1.0: every node) and the fraction of
    # a node's shares that must survive to unmask it: at least 2/3, or devices refuse the round (a server that
    # tells nodes different dropout lists can unmask a node below it; fedrec_flwr/fedgnn/device_policy.py)
    secagg_shares: float = ranged(1.0, Range(0, 1, open_low=True, text="0 < fraction <= 1"))
    secagg_threshold: float = ranged(0.7, Range(0, 1, open_low=True, text="0 < fraction <= 1"))
    # user_dp: the noise floor. Each node's noise share is sized for this fraction of the run's nodes (and at
    # least 3) reporting, and devices refuse a secure sum with fewer, so no dropout releases a sum with less
    # noise than sigma C; with every node reporting the sum carries sigma / sqrt(fraction) (charged so)
    min_node_fraction: float = ranged(0.8, Range(0, 1, open_low=True, text="0 < fraction <= 1"))
    # user_dp: evaluation inside the guarantee. Each user's (SSE, SAE, n) on its test ratings, its errors clipped
    # at half the scale and its weight capped at eval_max_ratings ratings, normalised and clipped to L2 norm 1, go
    # through SecAgg+ with the nodes' noise shares of std eval_noise_multiplier (at the floor); every evaluation
    # (after each federation.eval_every-th training round and the last) is charged to the user-level budget
    # sigma_e; 0 (default): calibrated so that the run's planned evaluations alone spend eval_budget_share of
    # target_epsilon (the training sigma is then calibrated for the rest)
    eval_noise_multiplier: float = ranged(0.0, _NON_NEGATIVE)
    eval_budget_share: float = ranged(0.1, Range(0, 1, open_low=True, open_high=True, text="0 < share < 1"))
    eval_max_ratings: int = ranged(10, _AT_LEAST_ONE)
    # user_dp with model.population_bias: b_pop's pull bounded on its own at this fraction of clip_norm, out of the
    # joint norm (the rest clipped to clip_norm sqrt(1 - fraction^2), so a user's whole update stays within
    # clip_norm: no privacy cost), and weighted by the user's ratings up to population_ratings, so that b_pop
    # settles at the ratings' mean a cold user's ratings follow (`user_dp.PopulationPull`). 0: the pull inside the
    # joint clip, scaled by each user's clip factor (b_pop then settles at a mean over users, light ones dominating)
    population_clip: float = ranged(0.0, Range(0, 1, open_high=True, text="0 <= fraction < 1"))
    population_ratings: int = ranged(20, _AT_LEAST_ONE)

    # M: the uniform sampler draws max(M, K) pseudo items for K own items
    pseudo_items: int = ranged(1000, _NON_NEGATIVE)
    # "uniform": pseudo items uniformly among the unrated items (the paper); "popularity": in every
    # popularity stratum `pseudo_ratio` pseudo items per own item, from a popularity the users report
    # under LDP before registration (fedrec_flwr.privacy.popularity)
    pseudo_sampler: str = "uniform"
    pseudo_ratio: int = ranged(2, _AT_LEAST_ONE)
    popularity_bins: int = ranged(64, _AT_LEAST_ONE)  # strata of equal size, by the reported popularity
    popularity_epsilon: float = ranged(4.0, _POSITIVE)  # LDP epsilon of each bit of a user's popularity report
    ldp: bool = True
    clip_delta: float = ranged(0.1, _NON_NEGATIVE)
    noise_lambda: float = ranged(0.2, _NON_NEGATIVE)  # and > 0 when privacy.ldp (checked in _validate)
    # the delta at which the accounted (epsilon, delta) budgets are reported
    delta: float = ranged(1e-5, Range(0, 1, open_low=True, open_high=True, text="0 < delta < 1"))


@dataclass
class FederationConfig:
    """Round structure of a federated run (FedGNN and FPPDM)."""

    rounds: int = ranged(30, _AT_LEAST_ONE)
    clients_per_round: int = ranged(128, _AT_LEAST_ONE)
    # a round with fewer accepted updates leaves the model unchanged; and <= clients_per_round (checked in _validate)
    min_clients: int = ranged(2, _AT_LEAST_ONE)
    eval_every: int = ranged(5, _AT_LEAST_ONE)
    # seconds a round waits for replies (0: no limit); late clients count as failures; 0: no limit
    round_timeout: float = ranged(0.0, _NON_NEGATIVE)
    # share of users (seeded sample) that evaluate; 1.0: every user
    eval_fraction: float = ranged(1.0, Range(0, 1, open_low=True, text="0 < fraction <= 1 (some users must evaluate)"))


@dataclass
class LocalTrainingConfig:
    """FedGNN on the device: what each sampled user computes before it protects its upload."""

    steps: int = ranged(1, _AT_LEAST_ONE)  # mini-batch steps per round, averaged into one upload
    # "gradient": every step's gradient at the downloaded weights (the paper); "delta": the steps train a
    # local copy of the model and item rows by SGD at `lr` on gradients clipped to privacy.clip_delta, and
    # the upload is the whole local change over lr, clipped and noised as one upload (the same cost)
    upload: str = "gradient"
    lr: float = ranged(0.001, _POSITIVE)  # local SGD rate of the model and item rows ("delta" uploads)
    batch_size: int = ranged(64, _AT_LEAST_ONE)
    # uploaded gradients of the "mean" or "sum" of squared errors over the mini-batch. Under the paper's LDP "sum"
    # scales the item rows only: the model weights keep the mean loss's gradient, which the per-coordinate clip and
    # noise hide (a summed one showed the server the rated items); user-level DP scales both
    loss: str = "mean"
    user_lr: float = ranged(0.01, _POSITIVE)  # SGD rate of the private user embedding
    # SGD steps on the private user embedding per round (>= 1; no privacy cost)
    user_steps: int = ranged(1, _AT_LEAST_ONE)


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
    trim_fraction: float = ranged(0.1, Range(0, 0.5, open_high=True, text="0 <= fraction < 0.5"))
    # bound on the L2 norm of one user's upload (model gradients and item rows together) when
    # privacy.ldp is off (0: no bound). With LDP on the bound is the mechanism's own (fedgnn.bounds)
    upload_norm_bound: float = ranged(0.0, _NON_NEGATIVE)  # 0: no bound


@dataclass
class TrivialConfig:
    """The `trivial` overhead baseline."""

    payload_floats: int = ranged(16, _AT_LEAST_ONE)  # floats each client echoes per round


@dataclass
class SimulationConfig:
    """How a simulation maps users onto virtual SuperNodes and what each ClientApp may use."""

    # users multiplexed per virtual SuperNode (deployment: always one node per user). 0 (auto): the federation's
    # SuperNodes share the users evenly, ceil(users / nodes) each, and `fedrec run` starts one node per worker it
    # can run at once (`federation_size.auto_nodes`), so each node's sampled users train as one batch and every
    # core works; a plain `flwr run .` spreads the users over the nodes of whatever federation it was given
    users_per_node: int = ranged(0, _NON_NEGATIVE)
    # FedGNN: how many of a node's sampled users compute their local steps as one batched computation
    # (fedrec_flwr.fedgnn.local_step; the same numbers as one at a time, up to float rounding); 1: one at a time
    user_batch: int = ranged(32, _AT_LEAST_ONE)
    num_cpus: float = ranged(1.0, _NON_NEGATIVE)  # Ray resources per ClientApp
    # fractional GPU per ClientApp; > 0 moves models and batches to CUDA; may exceed 1: several GPUs per ClientApp
    num_gpus: float = ranged(0.0, _NON_NEGATIVE)
    device: str = "auto"  # "auto": cuda when num_gpus > 0 and a GPU is visible, else cpu; or "cpu"/"cuda"
    # false: the ServerApp drops Flower's own INFO lines of every round and its end-of-run History dump
    # (fedrec_flwr.reporting.logs), leaving one `[fedgnn]` / `[fppdm]` line per round; true: show them (also in a
    # deployment)
    flower_logs: bool = False
    # the simulated devices' secrets, the source of every privacy draw: "" (default) each simulated device draws
    # its own from the OS, fresh every run; a file path (64 hex characters, mode 600; created if missing): every
    # simulated device derives its secret from it, so the run replays bit for bit. Read by the ClientApps only,
    # never by the ServerApp; results.json says which of the two a run used (`fedrec run --device-secrets FILE`)
    device_secrets: str = ""


@dataclass
class DeploymentConfig:
    """A real federation: which authenticated SuperNode may speak for which user or domain."""

    # JSON file {node id: [user ids]} (FedGNN) or {node id: [domain index]} (FPPDM) written by the operator from the
    # node ids that `flwr supernode register --format json` printed; nodes not listed register nobody
    node_list: str = ""
    min_nodes: int = ranged(0, _NON_NEGATIVE)  # registration waits for this many SuperNodes (devices connect over time)
    # how long round 1 waits for the expected SuperNodes before failing
    node_wait_seconds: float = ranged(300.0, _NON_NEGATIVE)


@dataclass
class FaultConfig:
    """Failure injection (off by default): per sampled node and training round, seeded."""

    crash: float = ranged(0.0, _PROBABILITY)  # probability that the node's fit raises (client crash)
    # probability that the node replies only after `straggle_seconds` (a timeout)
    straggle: float = ranged(0.0, _PROBABILITY)
    straggle_seconds: float = ranged(30.0, _NON_NEGATIVE)
    malformed: float = ranged(0.0, _PROBABILITY)  # probability that the node uploads NaN gradients (must be rejected)


@dataclass
class CheckpointConfig:
    """Server checkpoints every `every` training rounds (0: off); `resume` continues from `dir`."""

    every: int = ranged(0, _NON_NEGATIVE)  # 0: off
    dir: str = ""  # default: <output_dir>/checkpoint
    resume: bool = False


@dataclass
class ServerOptConfig:
    """Optimiser the strategy applies to the aggregated gradients."""

    name: str = "sgd"
    lr: float = ranged(0.01, _POSITIVE)
    momentum: float = ranged(0.0, Range(0, 1, open_high=True, text="0 <= momentum < 1"))
    # learning rate of the item table (0: same as lr). Item rows are far noisier than the model's
    # gradients under LDP (each item's row averages few real uploads), so they want their own rate
    item_lr: float = ranged(0.0, _NON_NEGATIVE)  # 0: same as lr
    # learning rate of the population bias b_pop (model.population_bias; 0: same as lr). It starts at the scale's
    # midpoint and must travel to the data's mean (0.7 of a star on Douban) within the run; one scalar whose summed
    # gradient is the strongest signal of any weight, so it can move faster than the rest
    population_lr: float = ranged(0.0, _NON_NEGATIVE)
    # Adam's beta1 for the item table: a higher value averages each row's noisy merged gradient
    # over more rounds before it moves the row
    item_beta1: float = ranged(0.9, Range(0, 1, open_high=True, text="0 <= beta1 < 1"))
    # both learning rates are multiplied by this after every training round (1.0: constant)
    lr_decay: float = ranged(1.0, Range(0, 1, open_low=True, text="0 < decay <= 1"))
    # decoupled weight decay of the item table (AdamW style): every row shrinks by item rate x this
    # after each round. Rows of rarely rated items are mostly accumulated LDP noise; decay bounds it
    item_weight_decay: float = ranged(0.0, _NON_NEGATIVE)  # and item rate x it < 1 (checked in _validate)

    @property
    def item_rate(self) -> float:
        """The item table's starting learning rate: item_lr, or lr when item_lr is 0."""
        return self.item_lr or self.lr


@dataclass
class ExpansionConfig:
    """Privacy-preserving graph expansion with neighbour users."""

    mode: str = "none"
    # T: expansion runs after T epochs (epoch = users / clients_per_round rounds); 0: expand right after registration,
    # before any training round
    epoch: int = ranged(2, _NON_NEGATIVE)
    max_neighbours: int = ranged(10, _NON_NEGATIVE)  # N
    # fixed mode: every user re-expands (submits its current embedding, fetches its neighbours' current ones) every
    # this many training rounds after the first expansion; 0: the neighbours stay as fetched at the first
    refresh_every: int = ranged(0, _NON_NEGATIVE)
    # who a user's neighbours are: users sharing the most rated items (the paper), or users drawn at random from
    # the run's users (a control for measuring what shared items add; the service still gets the item tokens)
    match: str = "shared_items"
    service_address: str = ""  # host:port of a running service; empty: start one on loopback
    retries: int = ranged(3, _NON_NEGATIVE)  # client retries when the service is unreachable
    # file holding the service's admin token (to open / close runs); empty: $FEDREC_NB_ADMIN_TOKEN.
    # Not the token itself: the run config also reaches every client
    service_token_file: str = ""
    ca_file: str = ""  # CA certificate the service's TLS certificate must chain to; empty: plain HTTP


@dataclass
class CentralizedConfig:
    """Reference trainer with all data in one place."""

    epochs: int = ranged(40, _AT_LEAST_ONE)
    lr: float = ranged(0.001, _POSITIVE)
    batch_users: int = ranged(64, _AT_LEAST_ONE)
    weight_decay: float = ranged(5e-4, _NON_NEGATIVE)


@dataclass
class FPPDMModelConfig:
    """A domain's model: LightGCN embeddings as diagonal Gaussians (or points), and how users start."""

    dim: int = ranged(128, _AT_LEAST_ONE)  # D: size of every user's and item's mu (and sigma)
    layers: int = ranged(3, _AT_LEAST_ONE)  # LightGCN propagation layers
    gaussian: bool = True  # false: point embeddings (sigma = 0, W2 becomes Euclidean): the LightGCN baseline
    shared_user_init: bool = False  # users start from a draw seeded by their global id in every domain


@dataclass
class FPPDMTrainingConfig:
    """A domain's local training each round: Adam on the W2 metric loss plus the pull to the global users."""

    lr: float = ranged(0.001, _POSITIVE)  # Adam's learning rate
    # training interactions per step (each step propagates the graph around them)
    batch_size: int = ranged(256, _AT_LEAST_ONE)
    local_epochs: int = ranged(5, _AT_LEAST_ONE)  # passes over the domain's interactions per round
    margin: float = ranged(1.0, _POSITIVE)  # hinge margin between W2(user, positive) and W2(user, negative)
    lambda_p: float = ranged(0.05, _NON_NEGATIVE)  # weight of W2(local user, global user)
    # each step propagates only the graph rows its batch's users and items depend on, with scipy's CSR
    # kernels and a fused Adam (CPU; the same numbers up to float rounding); false: the whole graph every step
    row_propagation: bool = True


@dataclass
class CoClusteringConfig:
    """FPPDM++: compactness co-clustering of a domain's users, and the weight of its loss."""

    # weight of W2(user, its cluster); 0 disables co-clustering (plain FPPDM); 0 disables co-clustering
    lambda_c: float = ranged(0.0, _NON_NEGATIVE)
    clusters: int = ranged(15, _AT_LEAST_ONE)  # M: eigenvectors kept and clusters formed
    knn: int = ranged(10, _AT_LEAST_ONE)  # neighbours per user in the sparse similarity S
    epsilon: float = ranged(0.05, _POSITIVE)  # entropy regulariser of S
    eta: float = ranged(0.1, _POSITIVE)  # entropy regulariser of the k-means assignment


@dataclass
class SecureAggregationConfig:
    """Paillier secure aggregation of the users' (mu, sigma): the server only multiplies ciphertexts."""

    enabled: bool = False
    key_file: str = ""  # the domains' shared Paillier key pair (JSON); never read by the server
    # modulus size; the server checks ciphertext widths against it; shorter Paillier moduli are factored quickly
    key_bits: int = ranged(2048, Range(512))


@dataclass
class FPPDMEvaluationConfig:
    """Leave-one-out ranking of each domain's test users."""

    negatives: int = ranged(99, _AT_LEAST_ONE)  # sampled non-interacted items ranked against each test positive
    topk: list[int] = ranged_list(lambda: [5, 10], _AT_LEAST_ONE)  # K of HR@K and NDCG@K


@dataclass
class FPPDMServerConfig:
    """What the server does with the domains' uploads: whether it aggregates, and which values it accepts."""

    aggregate: bool = True  # false: every domain trains alone (the single-domain baseline)
    # bounds on a domain's upload, and on the barycenters a domain trains towards: |mu| <= max_abs_mu and
    # sigma <= max_sigma. 0 (the default): derived from the model's scale, `fppdm.rounds.value_bounds`:
    # |mu| <= 4 sqrt(margin) and sigma <= 1 + 4 sqrt(margin) (honest values measured: |mu| <= 0.7, sigma <= 1.6)
    max_abs_mu: float = ranged(0.0, _NON_NEGATIVE)
    max_sigma: float = ranged(0.0, _NON_NEGATIVE)


@dataclass
class FPPDMConfig:
    """FPPDM / FPPDM++: per-domain Gaussian LightGCN, Wasserstein metric loss, barycenter server."""

    model: FPPDMModelConfig = field(default_factory=FPPDMModelConfig)
    training: FPPDMTrainingConfig = field(default_factory=FPPDMTrainingConfig)
    coclustering: CoClusteringConfig = field(default_factory=CoClusteringConfig)
    secure: SecureAggregationConfig = field(default_factory=SecureAggregationConfig)
    evaluation: FPPDMEvaluationConfig = field(default_factory=FPPDMEvaluationConfig)
    server: FPPDMServerConfig = field(default_factory=FPPDMServerConfig)


@dataclass
class AppConfig:
    """Everything a run needs, validated."""

    algorithm: str = "fedgnn"
    preset: str = "fedgnn_paper"
    seed: int = ranged(0, _ANY)
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
    "data.holdout": ("test", "validation"),
    "merge.items": ("clients", "count"),
    "local.loss": ("mean", "sum"),
    "local.upload": ("gradient", "delta"),
    "privacy.pseudo_sampler": ("uniform", "popularity"),
    "merge.robust": ("mean", "median", "trimmed"),
    "server_opt.name": ("sgd", "adam"),
    "expansion.mode": ("none", "fixed", "trainable"),
    "expansion.match": ("shared_items", "random"),
    "simulation.device": ("auto", "cpu", "cuda"),
    "data.synthetic.scale": ("1-5", "0.5-5", "1-100"),
}


def numeric_keys(cls: type | None = None, prefix: str = "") -> dict[str, Range | None]:
    """Dotted name -> declared range (None: undeclared) of every int, float and list-of-number key, walked
    from the dataclasses so that every new key is checked."""
    keys: dict[str, Range | None] = {}
    cls = cls or AppConfig
    hints = get_type_hints(cls)
    for f in fields(cls):
        kind = hints[f.name]
        if is_dataclass(kind):
            keys.update(numeric_keys(kind, f"{prefix}{f.name}."))
        elif kind in (int, float) or (get_origin(kind) is list and set(get_args(kind)) <= {int, float}):
            keys[prefix + f.name] = f.metadata.get("range")
    return keys


def _preset_path(name: str) -> Path:
    return CONF_DIR / f"{name}.yaml"


def dataset_conf_paths(name: str) -> list[Path]:
    """The settings files of dataset `name` that exist, lowest first: its family's
    conf/datasets/families/<family>.yaml (e.g. every `disencdr:<a>_<b>` pair), then its own
    conf/datasets/<name>.yaml; each optionally per algorithm, merged over a preset."""
    family = dataset_family(name)
    paths = [CONF_DIR / "datasets" / "families" / f"{family}.yaml"] if family else []
    paths.append(CONF_DIR / "datasets" / f"{name.replace(':', '_').replace('/', '_')}.yaml")
    return [p for p in paths if p.is_file()]


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


def _merge(base, layer, source: str):
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(getattr(exc, "msg", exc)).splitlines()[0]  # the rest repeats the key and type names
        raise ConfigError(f"{source}: invalid key '{key}': {reason}") from exc


Layer = tuple[str, DictConfig]  # (where a layer of settings comes from, its settings)


def _preset_layers(preset: str, chain: tuple[str, ...] = ()) -> tuple[list[Layer], list[str]]:
    """conf/<preset>.yaml's layers, after those of the preset its `base:` key names (if any), and the presets
    merged, root base first (their dataset files apply in that order)."""
    if preset in chain:
        raise ConfigError(f"conf/{preset}.yaml: presets inherit in a cycle: {' -> '.join([*chain, preset])}")
    layer = _load_yaml(_preset_path(preset), "preset", available_presets())
    base = layer.pop("base", None) if isinstance(layer, DictConfig) else None
    layers: list[Layer] = []
    lineage: list[str] = []
    if base is not None:
        try:
            layers, lineage = _preset_layers(str(base), (*chain, preset))
        except ConfigError as exc:
            raise ConfigError(f"conf/{preset}.yaml, key 'base': {exc}") from exc
    return [*layers, (f"conf/{preset}.yaml", layer)], [*lineage, preset]


def _dataset_file_layers(path: Path, algorithm: str) -> list[Layer]:
    """conf/datasets/<dataset>.yaml's layers: its top-level keys, then its `algorithms.<algorithm>` section.

    `algorithms` maps an algorithm name to settings in the AppConfig layout that apply to every
    preset of that algorithm on this dataset; every section is checked, only the preset's own applies.
    """
    source = str(path.relative_to(CONF_DIR.parent))
    layer = _load_yaml(path, "settings file", [])
    sections = layer.pop("algorithms", None) if isinstance(layer, DictConfig) else None
    if sections is None:
        return [(source, layer)]
    unknown = sorted(set(sections) - set(ALGORITHMS)) if isinstance(sections, DictConfig) else [sections]
    if unknown:
        raise ConfigError(f"{source}: key 'algorithms' maps algorithm names {tuple(ALGORITHMS)} to settings; "
                          f"got {unknown}")
    for name, section in sections.items():  # every section must fit the config, whichever algorithm runs
        _merge(_merge(OmegaConf.structured(AppConfig), layer, source), section,
               f"{source}, section 'algorithms.{name}'")
    own = sections.get(algorithm)
    return [(source, layer)] + ([(f"{source}, section 'algorithms.{algorithm}'", own)] if own is not None else [])


def config_layers(preset: str = "fedgnn_paper", dataset: str | None = None, overrides: list[str] | None = None,
                  extra: Mapping[str, Any] | None = None) -> list[Layer]:
    """Every layer a run's config is merged from, lowest first, each named by its file or source.

    Later layers win: preset (after its `base:`) < conf/datasets/families/<family>.yaml, then
    conf/datasets/<dataset>.yaml (each: its top-level keys,
    then its section for the preset's algorithm) < conf/<base>/<dataset>.yaml for each preset it inherits
    from, root first < conf/<preset>/<dataset>.yaml < overrides < `extra`, already-typed values (e.g. from
    Flower's run config). The dataclass defaults lie under all of them.
    """
    layers, lineage = _preset_layers(preset)
    layers.append(("--preset", OmegaConf.create({"preset": preset})))
    merged = OmegaConf.structured(AppConfig)
    for source, layer in layers:
        merged = _merge(merged, layer, source)
    if dataset:
        layers.append(("--dataset", OmegaConf.create({"data": {"name": dataset}})))
    dataset = dataset or merged.data.name  # no dataset given: the preset's own default
    if dataset:
        file_layers = [layer for path in dataset_conf_paths(dataset)
                       for layer in _dataset_file_layers(path, merged.algorithm)]
        for name in lineage:  # a preset inherits its bases' dataset settings, its own win
            path = preset_dataset_conf_path(name, dataset)
            if path.is_file():
                file_layers.append((str(path.relative_to(CONF_DIR.parent)), _load_yaml(path, "settings file", [])))
        for source, layer in file_layers:
            if OmegaConf.select(layer, "data.name") is not None:
                raise ConfigError(f"{source}: a dataset's settings cannot set data.name (the dataset is chosen by "
                                  "--dataset or the preset)")
        layers += file_layers
    if overrides:
        for item in overrides:
            layer = OmegaConf.create()
            try:
                layer.merge_with_dotlist([item])
            except Exception as exc:
                raise ConfigError(f"override '{item}': {' '.join(str(exc).split())}") from exc
            layers.append((f"override {item}", layer))
    if extra:
        layers.append(("run config", OmegaConf.create(dict(extra))))
    return layers


def _get(cfg: AppConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _check_number(key: str, value: Any, rule: Range | None) -> None:
    """ConfigError naming `key` unless `value` (a number or a non-empty list of them) is finite and in `rule`."""
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError(f"config key '{key}' = []; expected a non-empty list")
    rule = rule or Range()
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
    for key, rule in numeric_keys().items():
        _check_number(key, _get(cfg, key), rule)
    if cfg.checkpoint.resume and cfg.expansion.mode == "trainable":
        raise ConfigError("checkpoint.resume does not support expansion.mode = 'trainable' (the neighbour "
                          "service's submissions are not checkpointed); use 'fixed' or 'none'")
    if cfg.expansion.refresh_every and cfg.expansion.mode != "fixed":
        raise ConfigError(f"config key 'expansion.refresh_every' = {cfg.expansion.refresh_every} re-expands fixed "
                          f"neighbours; expansion.mode = {cfg.expansion.mode!r} (trainable refreshes every round a "
                          "user trains); set expansion.mode = fixed or refresh_every = 0")
    if cfg.model.user_offset_reg > 0 and not cfg.model.user_offset:
        raise ConfigError(f"config key 'model.user_offset_reg' = {cfg.model.user_offset_reg} needs "
                          "model.user_offset = true (there is no private offset to shrink otherwise)")
    needs_population = [key for key, value in (("model.personal_shrink", cfg.model.personal_shrink),
                                               ("server_opt.population_lr", cfg.server_opt.population_lr),
                                               ("privacy.population_clip", cfg.privacy.population_clip),
                                               ("model.population_item_weight", cfg.model.population_item_weight))
                        if value > 0]
    if needs_population and not cfg.model.population_bias:
        key = needs_population[0]
        raise ConfigError(f"config key '{key}' needs model.population_bias = true (the population part it "
                          "weighs or trains is otherwise the full model's b, which does not learn the mean)")
    if cfg.model.population_item_weight > 0 and not (cfg.model.biases or cfg.model.item_bias):
        raise ConfigError(f"config key 'model.population_item_weight' = {cfg.model.population_item_weight} needs "
                          "model.biases or model.item_bias = true (the items' own terms it trains)")
    if cfg.model.user_offset_init != "zero" and not cfg.model.user_offset:
        raise ConfigError(f"config key 'model.user_offset_init' = {cfg.model.user_offset_init!r} needs "
                          "model.user_offset = true (there is no private offset to start otherwise)")
    try:
        mode = privacy_mode(cfg.privacy.mode)  # the registry's modes (a plug-in registers there)
    except ValueError:
        raise ConfigError(f"config key 'privacy.mode' = {cfg.privacy.mode!r}; expected one of "
                          f"{tuple(PRIVACY_MODES)}") from None
    mode.check_config(cfg)  # the combinations the run's privacy mode refuses
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
    """Resolve a preset, its dataset files and key=value overrides into a validated AppConfig
    (the layers and their precedence: `config_layers`)."""
    cfg = OmegaConf.structured(AppConfig)
    for source, layer in config_layers(preset, dataset, overrides, extra):
        cfg = _merge(cfg, layer, "override" if source.startswith("override ") else source)
    typed: AppConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    _validate(typed)
    return typed


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of a nested dict."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}{key}."))
    return out


def explain_config(preset: str = "fedgnn_paper", dataset: str | None = None,
                   overrides: list[str] | None = None) -> list[tuple[str, Any, str]]:
    """(key, value, source) of every value of the resolved config that differs from the dataclass default,
    in the config's key order, with the last layer that set it (`config_layers`): what `fedrec config
    --explain` prints."""
    final = _leaves(to_dict(load_config(preset, dataset, overrides)))
    default = _leaves(to_dict(AppConfig()))
    source_of: dict[str, str] = {}
    for source, layer in config_layers(preset, dataset, overrides):
        for key in _leaves(OmegaConf.to_container(layer, resolve=True)):
            source_of[key] = source
    return [(key, value, source_of.get(key, "?")) for key, value in final.items() if value != default.get(key)]


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
