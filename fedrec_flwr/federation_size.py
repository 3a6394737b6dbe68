"""How many SuperNodes a simulated federation needs, read from the data (the algorithm registry names these)."""

from __future__ import annotations


def user_nodes(cfg) -> int:
    """SuperNodes of a per-user simulation: one per `simulation.users_per_node` users."""
    from fedrec_flwr.data import UserPartitions, prepare_partitions

    num_users = UserPartitions(prepare_partitions(cfg.data)).meta.num_users
    return -(-num_users // cfg.simulation.users_per_node)


def domain_nodes(cfg) -> int:
    """SuperNodes of a per-domain simulation: one per domain."""
    from fedrec_flwr.data import load_multidomain

    return len(load_multidomain(cfg.data).domains)
