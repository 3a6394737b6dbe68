"""ClientApp entry point: Flower context (run config + node identity) -> the right NumPyClient."""

from __future__ import annotations

import functools
import logging

import torch
from flwr.client import ClientApp
from flwr.common import Context

from clients.fedgnn import FedGNNClient
from clients.trivial import TrivialClient
from clients.fppdm import FPPDMDomainClient
from clients.user_store import DomainStateStore, NodeStateStore
from fedrec_flwr.config import AppConfig, from_run_config
from fedrec_flwr.data import MultiDomainDataset, UserPartitions, load_multidomain, prepare_partitions

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
    """The user a node serves: `user-id` in deployment, `partition-id` in simulation."""
    for key in ("user-id", "partition-id"):
        if key in node_config:
            return int(node_config[key])
    raise KeyError("node config has neither 'user-id' nor 'partition-id'")


def client_fn(context: Context):
    """Build the client of the user (or domain) this node serves."""
    torch.set_num_threads(1)
    key = tuple(sorted(context.run_config.items()))
    cfg = _config(key)
    if cfg.algorithm == "trivial":
        return TrivialClient().to_client()
    if cfg.algorithm == "fppdm":
        index = user_of(context.node_config)
        domains = _multidomain(key).domains
        if index >= len(domains):
            raise ValueError(f"node {index} has no domain: dataset {cfg.data.name} has {len(domains)} (one SuperNode per domain)")
        return FPPDMDomainClient(cfg, domains[index], index, DomainStateStore(context.state)).to_client()
    parts = _partitions(key)
    data = parts.user(user_of(context.node_config))
    return FedGNNClient(cfg, parts.meta, data, NodeStateStore(context.state)).to_client()


app = ClientApp(client_fn=client_fn)
