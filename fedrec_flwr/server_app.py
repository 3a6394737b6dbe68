"""ServerApp entry point: run config -> validated AppConfig -> strategy -> ServerAppComponents."""

from __future__ import annotations

import logging

from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from fedrec_flwr.config import from_run_config, to_dict
from fedrec_flwr.data import UserPartitions, prepare_partitions
from fedrec_flwr.results import RunRecorder
from clients.trivial import trivial_parameters
from strategies.fedgnn_merge import FedGNNStrategy
from strategies.timed_fedavg import TimedFedAvg

log = logging.getLogger(__name__)


def server_fn(context: Context) -> ServerAppComponents:
    """Prepare the data partitions once, then wire the FedGNN strategy for `rounds` + 1 rounds."""
    cfg = from_run_config(context.run_config)
    if cfg.algorithm == "trivial":
        return _trivial_components(cfg)
    parts = UserPartitions(prepare_partitions(cfg.data))
    meta = parts.meta
    print(f"[fedgnn] dataset {meta.dataset}: {meta.num_users} users, {meta.num_items} items, "
          f"{meta.num_train} train / {meta.num_test} test ratings; output {cfg.output_dir}", flush=True)
    recorder = RunRecorder(cfg.output_dir, cfg.algorithm, meta.dataset, to_dict(cfg))
    strategy = FedGNNStrategy(cfg, meta.num_items, meta.scale.midpoint, recorder)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=cfg.federation.rounds + 1))


def _trivial_components(cfg) -> ServerAppComponents:
    """The baseline job: FedAvg over an echoed vector, for Flower's own per-round overhead."""
    recorder = RunRecorder(cfg.output_dir, "trivial", cfg.data.name, to_dict(cfg))
    strategy = TimedFedAvg(recorder, cfg.federation.clients_per_round, cfg.federation.rounds,
                           trivial_parameters(cfg.federation.trivial_payload_floats))
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=cfg.federation.rounds))


app = ServerApp(server_fn=server_fn)
