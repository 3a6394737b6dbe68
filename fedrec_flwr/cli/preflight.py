"""Each algorithm's checks before `fedrec run` hands a run to Flower (`Algorithm.preflight`): what its ServerApp
would otherwise find wrong only after Flower started. The operator's node list (NodeListError, an input error) and,
when resuming, the checkpoint against the run's config and dataset (CheckpointError, the run fails). Relative paths
are read from the project folder, as the ServerApp (started by `flwr run` there) reads them."""

from __future__ import annotations

from pathlib import Path

from fedrec_flwr.config import to_dict


def _in_project(path: str, root: Path) -> Path:
    return Path(path) if Path(path).is_absolute() else root / path


def _dataset_sizes(cfg, root: Path) -> tuple[int, int, int]:
    """(items, users, item features) of a FedGNN run's dataset, as its ServerApp reads them."""
    from fedrec_flwr.data import UserPartitions, prepare_partitions
    from fedrec_flwr.data.node_files import load_catalogue

    meta = load_catalogue(_in_project(cfg.data.catalogue, root))["meta"] if cfg.data.catalogue \
        else UserPartitions(prepare_partitions(cfg.data)).meta
    return meta.num_items, meta.num_users, meta.num_item_features


def fedgnn_preflight(cfg, num_nodes: int, root: Path) -> None:
    """A node list naming every user, and a resumed run's checkpoint, checked as the strategy will check it."""
    if cfg.deployment.node_list:
        from fedrec_flwr.node_list import load_node_list

        load_node_list(_in_project(cfg.deployment.node_list, root), _dataset_sizes(cfg, root)[1])
    if cfg.checkpoint.resume:
        from fedrec_flwr.fedgnn.checkpoint import Checkpointer, load_resumable

        folder = _in_project(cfg.checkpoint.dir, root) if cfg.checkpoint.dir else Path(cfg.output_dir) / "checkpoint"
        load_resumable(Checkpointer(folder), to_dict(cfg), *_dataset_sizes(cfg, root))


def fppdm_preflight(cfg, num_nodes: int, root: Path) -> None:
    """A node list naming every domain (one SuperNode each)."""
    if cfg.deployment.node_list:
        from fedrec_flwr.node_list import load_node_list

        load_node_list(_in_project(cfg.deployment.node_list, root), num_nodes)
