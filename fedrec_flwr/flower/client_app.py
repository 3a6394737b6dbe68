"""ClientApp entry point: Flower context (run config + node identity) -> the right NumPyClient."""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

import torch
from flwr.app import ConfigRecord
from flwr.client import ClientApp
from flwr.common import Context

from clients.privacy_guard import STATE_KEY, DeviceTerms, privacy_guard
from clients.user_store import DomainStateStore, NodeStateStore, UserStateFiles
from fedrec_flwr.algorithms import get_algorithm
from fedrec_flwr.config import AppConfig, from_run_config
from fedrec_flwr.data import (
    MultiDomainDataset,
    UserPartitions,
    load_multidomain,
    prepare_partitions,
)
from fedrec_flwr.data.node_files import load_domain_file, load_user_file
from fedrec_flwr.fedgnn.checkpoint import checkpoint_folder
from fedrec_flwr.privacy.device_secret import DeviceSecret
from fedrec_flwr.privacy_modes import privacy_mode
from fedrec_flwr.reporting.logs import configure_console_logging

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _config(items: tuple) -> AppConfig:
    return from_run_config(dict(items))


@functools.lru_cache(maxsize=4)
def _partitions(cfg_key: tuple) -> UserPartitions:
    return UserPartitions(prepare_partitions(_config(cfg_key).data))


@functools.lru_cache(maxsize=2)
def _multidomain(cfg_key: tuple) -> MultiDomainDataset:
    return load_multidomain(_config(cfg_key).data)


def user_of(node_config) -> int:
    """The user (or domain) a node serves: `user-id` in deployment, `partition-id` in simulation."""
    for key in ("user-id", "partition-id"):
        if key in node_config:
            return int(node_config[key])
    raise KeyError("node config has neither 'user-id' nor 'partition-id'")


def users_of(node_config, users_per_node: int, num_users: int) -> list[int]:
    """The users a node hosts: its one `user-id` in deployment; in simulation, partition p hosts
    users p*U .. p*U + U - 1 (U = simulation.users_per_node, or with 0 ceil(users / the federation's
    `num-partitions`): `federation_size.hosted_per_node`)."""
    from fedrec_flwr.flower.federation_size import hosted_per_node

    if "user-id" in node_config:
        return [int(node_config["user-id"])]
    p = int(node_config["partition-id"])
    users_per_node = hosted_per_node(users_per_node, num_users, int(node_config.get("num-partitions", 1)))
    users = list(range(p * users_per_node, min((p + 1) * users_per_node, num_users)))
    if not users:
        raise ValueError(f"partition {p} hosts no user: {num_users} users at {users_per_node} per node "
                         f"need {-(-num_users // users_per_node)} SuperNodes")
    return users


def client_device(cfg: AppConfig) -> torch.device:
    """cuda when the config gives clients a GPU share (or asks for cuda) and one is visible, else cpu."""
    want = cfg.simulation.device
    if want == "cuda" or (want == "auto" and cfg.simulation.num_gpus > 0):
        if not torch.cuda.is_available():
            if want == "cuda":
                raise RuntimeError("simulation.device = 'cuda' but torch sees no CUDA device on this node")
            return torch.device("cpu")
        return torch.device("cuda")
    return torch.device("cpu")


def state_files(cfg: AppConfig, node_config) -> UserStateFiles | None:
    """Where hosted users keep their state on disk: node-config `state-dir` (a device's own disk),
    else <checkpoint dir>/clients when checkpoints are on; None: memory only."""
    if node_config.get("state-dir"):
        return UserStateFiles(Path(str(node_config["state-dir"])))
    if cfg.checkpoint.every or cfg.checkpoint.resume:
        return UserStateFiles(checkpoint_folder(cfg) / "clients")
    return None


@functools.lru_cache(maxsize=8)
def _fixed_secret(path: str) -> DeviceSecret:
    return DeviceSecret.load_or_create(path)


def device_secret(cfg: AppConfig, context: Context) -> DeviceSecret:
    """The secret this device draws its privacy randomness from; never sent, never in the run config.

    - a node with a `state-dir` (a deployed device): `<state-dir>/device-secret`, drawn from the OS at its first start;
    - a simulated node of a run with `simulation.device_secrets` (the experimenter's file): that secret, so the run
      replays bit for bit (each user's streams are keyed by its id as well, so users never share a stream);
    - otherwise: one drawn from the OS at the node's first message and kept in its node state for the run.
    A deployed node (`user-id` or `data-path` in its node config) never reads a path from the run config, which the
    server writes."""
    nc = context.node_config
    if nc.get("state-dir"):
        return DeviceSecret.load_or_create(Path(str(nc["state-dir"])) / "device-secret")
    if cfg.simulation.device_secrets and not _deployed(nc):
        return _fixed_secret(str(Path(cfg.simulation.device_secrets).resolve()))
    rec = context.state.config_records.get(STATE_KEY) or ConfigRecord({})
    if "secret" not in rec:
        rec["secret"] = DeviceSecret.fresh().hex_for_node_state()
        context.state.config_records[STATE_KEY] = rec
    return DeviceSecret.from_node_state(str(rec["secret"]))


@functools.lru_cache(maxsize=8)
def _run_sigma(cfg_key: tuple, num_users: int) -> float:
    from fedrec_flwr.fedgnn.accounting import run_noise_multiplier

    cfg = _config(cfg_key)
    f = cfg.federation
    return run_noise_multiplier(cfg.privacy, f.clients_per_round, num_users, f.rounds, f.eval_every)


def _deployed(node_config) -> bool:
    """A real device (its own `user-id` or `data-path`), not a simulated node: its limits come from its node config."""
    return "user-id" in node_config or bool(node_config.get("data-path"))


def device_terms(context: Context) -> DeviceTerms:
    """What this device computes for itself about a user-DP run (`clients.privacy_guard.DeviceTerms`): its policy
    (the node config's limits in a deployment, the run's own settings in a simulation), q and sigma from the run's
    config and its own count of users, the noise floor K, and the SecAgg+ ranges an honest server sets. A deployed
    device without a `state-dir` is refused: its budget must outlive a run."""
    from fedrec_flwr.fedgnn.accounting import run_eval_noise_multiplier, sample_rate
    from fedrec_flwr.fedgnn.device_policy import DevicePolicy, PolicyRefusal, floor_nodes, share_std
    from fedrec_flwr.fedgnn.user_dp import secagg_clipping_range, secagg_quantization_range

    key = _key(context)
    cfg = _config(key)
    nc = context.node_config
    deployed = _deployed(nc)
    if deployed and not nc.get("state-dir"):
        raise PolicyRefusal("a deployed device keeps its privacy ledger in its state-dir, and its node config has none")
    if nc.get("data-path"):  # deployment: one user per node, the population from the device's own catalogue
        num_users = _user_file(str(nc["data-path"]))[0].num_users
        nodes, per_node = num_users, 1
    else:
        num_users = _partitions(key).meta.num_users
        per_node = 1 if deployed else cfg.simulation.users_per_node
        nodes = -(-num_users // per_node)
    sigma = _run_sigma(key, num_users)
    f = cfg.federation
    policy = DevicePolicy.from_node_config(nc) if deployed else DevicePolicy.from_run(
        cfg.privacy, sigma, run_eval_noise_multiplier(cfg.privacy, f.rounds, f.eval_every))
    run_floor = floor_nodes(cfg.privacy.min_node_fraction, nodes)
    floor = max(policy.floor_nodes(nodes), run_floor)
    ledger = Path(str(nc["state-dir"])) / "privacy-ledger.json" if nc.get("state-dir") else None
    p = cfg.privacy
    eval_sigma = run_eval_noise_multiplier(p, f.rounds, f.eval_every)
    return DeviceTerms(policy, sample_rate(f.clients_per_round, num_users), sigma, p.clip_norm, floor,
                       secagg_clipping_range(p.clip_norm, per_node, share_std(sigma, p.clip_norm, run_floor)),
                       secagg_quantization_range(nodes), ledger, eval_sigma,
                       secagg_clipping_range(1.0, per_node, share_std(eval_sigma, 1.0, run_floor)))


@functools.lru_cache(maxsize=2)
def _user_file(path: str):
    return load_user_file(path)


CLIENT_LOG_LEVEL = "FEDREC_CLIENT_LOG_LEVEL"  # the ClientApp processes' log level (default WARNING)


def client_fn(context: Context):
    """Build the client of the users (or domain) this node serves, for the configured algorithm."""
    torch.set_num_threads(1)
    configure_console_logging(_client_log_level())
    cfg = _config(_key(context))
    ray_node = _ray_node_id()
    if ray_node:  # a simulation's Ray actor: which cluster node ran which SuperNode, in that node's Ray logs
        log.info("ClientApp of node %s on Ray node %s", context.node_id, ray_node)
    return get_algorithm(cfg.algorithm).part("client")(cfg, context, client_device(cfg))


def _client_log_level() -> int:
    """The level from $FEDREC_CLIENT_LOG_LEVEL (a name such as INFO), WARNING when unset or unknown: an
    operator's switch for a device's own log, which stays on the device (a Ray node's worker logs in a
    simulation)."""
    level = logging.getLevelName(os.environ.get(CLIENT_LOG_LEVEL, "WARNING").upper())
    return level if isinstance(level, int) else logging.WARNING


def _ray_node_id() -> str | None:
    """The Ray node this ClientApp runs on, when it runs in a Ray actor of a simulation (never imports Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def _key(context: Context) -> tuple:
    return tuple(sorted(context.run_config.items()))


# Each factory imports its own client: a ClientApp process imports only its algorithm's code (the
# FedGNN device core is not imported by FPPDM or trivial nodes). None imports PyTorch Geometric (models.star_layers).
def trivial_client(cfg: AppConfig, context: Context, device: torch.device):
    """The overhead baseline's echo client."""
    from clients.trivial import TrivialClient

    return TrivialClient().to_client()


def fppdm_client(cfg: AppConfig, context: Context, device: torch.device):
    """One domain: its own `domain-<k>.npz` in deployment, else domain `partition-id` of the dataset."""
    from clients.fppdm import FPPDMDomainClient

    if context.node_config.get("data-path"):  # deployment: this node's own file, nothing else
        index, domain = load_domain_file(str(context.node_config["data-path"]))
    else:
        index = user_of(context.node_config)
        domains = _multidomain(_key(context)).domains
        if index >= len(domains):
            raise ValueError(f"node {index} has no domain: dataset {cfg.data.name} has {len(domains)} (one "
                             f"SuperNode per domain)")
        domain = domains[index]
    return FPPDMDomainClient(cfg, domain, index, DomainStateStore(context.state), device).to_client()


def fedgnn_client(cfg: AppConfig, context: Context, device: torch.device):
    """The users this node hosts: its one user's file in deployment, else partition p's users."""
    from clients.faults import with_faults
    from clients.fedgnn import FedGNNClient

    nc = context.node_config
    state_dir = nc.get("state-dir")
    if _deployed(nc) and not state_dir:
        raise ValueError("a deployed FedGNN device needs a state-dir (node config): its secret, draw counts and "
                         "committed anonymity set must outlive a run, or a server that runs it again gets fresh ones")
    store = NodeStateStore(context.state, state_files(cfg, nc),
                           Path(str(state_dir)) / "draws.json" if state_dir else None,
                           Path(str(state_dir)) / "anonymity-sets.json" if state_dir else None)
    secret = device_secret(cfg, context)
    terms = device_terms(context) if privacy_mode(cfg.privacy.mode).part("Device").needs_terms else None
    # a deployed device contacts only the neighbour service its own node config names, over TLS with its own CA file
    link = ({"neighbour_service": str(nc.get("neighbour-service", "")),
             "neighbour_ca": str(nc.get("neighbour-ca-file", ""))}
            if _deployed(nc) else {})
    if nc.get("data-path"):  # deployment: this node's own file, nothing else
        meta, data = load_user_file(str(nc["data-path"]))
        client = FedGNNClient(cfg, meta, [data.user], lambda u: data, store, device, secret=secret, terms=terms, **link)
    else:
        parts = _partitions(_key(context))
        users = users_of(nc, cfg.simulation.users_per_node, parts.meta.num_users)
        client = FedGNNClient(cfg, parts.meta, users, parts.user, store, device, secret=secret, terms=terms, **link)
    return with_faults(client, cfg.faults, cfg.seed).to_client()


def optional_secaggplus_mod(msg, context: Context, call_next):
    """Flower's `secaggplus_mod` for the training messages that carry a SecAgg+ config (user-level DP's training
    rounds); every other message passes straight through (the mod itself would refuse a plain training message)."""
    from flwr.app.message_type import MessageType
    from flwr.client.mod import secaggplus_mod

    if msg.metadata.message_type == MessageType.TRAIN and "secaggplus_configs" not in msg.content.config_records:
        return call_next(msg, context)
    return secaggplus_mod(msg, context, call_next)


def device_guard(msg, context: Context, call_next):
    """The device's own privacy policy on every message: a deployed FedGNN device takes part only in runs of the
    privacy mode its node config allows (user-level DP unless its operator opts into the paper's LDP), an LDP one
    only at the protection its policy asks (`DevicePolicy.admit_ldp`); in user-DP runs the guard of
    `clients.privacy_guard` wraps SecAgg+. A deployed device (any algorithm) keeps the reason of any failure in its
    own log: Flower hands an exception's text to the server, and a reason can tell it what the device holds (its
    spent epsilon, its limits and paths, or, before its coin is known to be used, whether its user sampled itself)."""
    from fedrec_flwr.fedgnn.device_policy import PolicyRefusal

    try:
        return _device_policy(msg, context, call_next)
    except Exception as exc:
        if not _deployed(context.node_config):
            raise  # a simulation's server is the experimenter: the reason helps
        log.warning("declined a %s message: %s: %s", msg.metadata.message_type, type(exc).__name__, exc)
        if isinstance(exc, PolicyRefusal):
            raise PolicyRefusal("refused by this device's privacy policy (the reason is in the device's log)") from None
        raise RuntimeError("this device could not answer (the reason is in the device's log)") from None


def _device_policy(msg, context: Context, call_next):
    """`device_guard`'s checks, then the rest of the ClientApp."""
    from flwr.app.message_type import MessageType

    from fedrec_flwr.fedgnn.device_policy import DevicePolicy

    cfg = _config(_key(context))
    if not get_algorithm(cfg.algorithm).privacy_modes:
        return call_next(msg, context)
    mode = privacy_mode(cfg.privacy.mode).device(cfg.privacy)
    if _deployed(context.node_config):
        policy = DevicePolicy.from_node_config(context.node_config)
        mode.admit(policy)
        if msg.metadata.message_type == MessageType.EVALUATE and mode.plain_evaluation:
            policy.admit_plain_evaluation()
    if not mode.needs_terms:
        return call_next(msg, context)
    return _GUARD(msg, context, call_next)


_GUARD = privacy_guard(device_terms)
app = ClientApp(client_fn=client_fn, mods=[device_guard, optional_secaggplus_mod])
