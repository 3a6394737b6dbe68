"""How many SuperNodes a simulated federation needs, and how many users each hosts (the algorithm registry names
these)."""

from __future__ import annotations

import math
import os


def auto_nodes(num_users: int, simulation) -> int:
    """The SuperNodes `fedrec run` starts when `simulation.users_per_node` is 0 (auto): one per ClientApp the
    simulation runs at once (the cores over `simulation.num_cpus`, and with `num_gpus` > 0 the visible GPUs over
    it), at most one per user. Each node then trains its sampled users as one batch, and every worker has a
    node: more nodes would only add Flower's per-message cost, fewer would leave cores idle. On a Ray cluster the
    cores are the cluster's: `$FEDREC_CLUSTER_CPUS` (deploy/ray_cluster_run.sh sets it) stands for this machine's."""
    cpus = int(os.environ.get("FEDREC_CLUSTER_CPUS") or 0) or os.cpu_count() or 1
    workers = max(1, int(cpus / max(simulation.num_cpus, 1e-9)))
    if simulation.num_gpus > 0:
        import torch

        if torch.cuda.is_available():
            workers = min(workers, max(1, int(torch.cuda.device_count() / simulation.num_gpus)))
    return max(1, min(num_users, workers))


def hosted_per_node(users_per_node: int, num_users: int, nodes: int) -> int:
    """U, the users each simulated node hosts: `simulation.users_per_node`, or (0, auto) ceil(users / nodes) for a
    federation of `nodes` SuperNodes, so that every user is hosted whatever the federation's size."""
    return users_per_node or max(1, math.ceil(num_users / max(nodes, 1)))


def user_nodes(cfg) -> int:
    """SuperNodes of a per-user simulation: one per `simulation.users_per_node` users, or (auto) `auto_nodes`."""
    from fedrec_flwr.data import UserPartitions, prepare_partitions

    num_users = UserPartitions(prepare_partitions(cfg.data)).meta.num_users
    if cfg.simulation.users_per_node == 0:
        return auto_nodes(num_users, cfg.simulation)
    return -(-num_users // cfg.simulation.users_per_node)


def domain_nodes(cfg) -> int:
    """SuperNodes of a per-domain simulation: one per domain."""
    from fedrec_flwr.data import load_multidomain

    return len(load_multidomain(cfg.data).domains)
