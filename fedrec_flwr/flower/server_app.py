"""ServerApp entry point: run config -> validated AppConfig -> strategy -> ServerAppComponents."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from fedrec_flwr.algorithms import get_algorithm
from fedrec_flwr.config import from_run_config, to_dict
from fedrec_flwr.data import UserPartitions, load_multidomain, prepare_partitions
from fedrec_flwr.data.node_files import load_catalogue
from fedrec_flwr.fedgnn.expansion import open_expansion_link
from fedrec_flwr.reference.baselines import baseline_rmses, baselines_on_users
from fedrec_flwr.reporting.logs import configure_console_logging, show_flower_round_logs
from fedrec_flwr.reporting.results import RunRecorder

log = logging.getLogger("fedrec_flwr.server")


def server_fn(context: Context) -> ServerAppComponents:
    """Validate the run config, then build the strategy of the configured algorithm (fedrec_flwr.algorithms)."""
    configure_console_logging()
    cfg = from_run_config(context.run_config)
    show_flower_round_logs(cfg.simulation.flower_logs)  # off: one `[fedgnn]` / `[fppdm]` line per round
    try:
        return get_algorithm(cfg.algorithm).part("server")(cfg)
    except Exception as exc:
        _record_failure(cfg, exc)
        raise


def _record_failure(cfg, exc: BaseException) -> None:
    """Leave a results.json that says the run failed and why, so nothing reads an older run's results."""
    RunRecorder(cfg.output_dir, cfg.algorithm, cfg.data.name, to_dict(cfg)).fail(f"{type(exc).__name__}: {exc}")


# Each factory imports its own strategy: a ServerApp process imports only its algorithm's code (FedGNN's
# round core, models and privacy mechanisms are not imported by an FPPDM or trivial run).
def fedgnn_components(cfg) -> ServerAppComponents:
    """FedGNN: partitions prepared once (simulation) or the public catalogue (deployment), then the
    strategy for registration + `rounds` training rounds (+ expansion)."""
    from strategies.fedgnn import FedGNNStrategy

    baselines = baselines_of = None
    if cfg.data.catalogue:  # deployment: public dataset facts only, the ratings stay on the devices
        meta = load_catalogue(cfg.data.catalogue)["meta"]
    else:  # simulation: the data is here anyway, so record what a model must beat, on the ratings it is scored on
        parts = UserPartitions(prepare_partitions(cfg.data))
        ratings = parts.ratings()
        meta, baselines = parts.meta, baseline_rmses(ratings)

        def baselines_of(users: list[int]) -> tuple[dict[str, float], int]:
            return baselines_on_users(ratings, users)
    log.info("dataset %s: %d users, %d items, %d train / %d test ratings; output %s", meta.dataset, meta.num_users,
             meta.num_items, meta.num_train, meta.num_test, cfg.output_dir)
    recorder = RunRecorder(cfg.output_dir, cfg.algorithm, meta.dataset, to_dict(cfg))
    if baselines is not None:
        recorder.set_baselines(baselines)
    link = open_expansion_link(cfg, meta.num_items) if cfg.expansion.mode != "none" else None
    strategy = FedGNNStrategy(cfg, meta.num_items, meta.scale.midpoint, recorder, meta.num_users, link,
                              num_item_features=meta.num_item_features, rating_span=meta.scale.span,
                              test_ratings=meta.num_test, baselines=baselines_of)
    timeout = cfg.federation.round_timeout or None
    return ServerAppComponents(strategy=strategy,
                               config=ServerConfig(num_rounds=strategy.num_rounds, round_timeout=timeout))


def fppdm_components(cfg) -> ServerAppComponents:
    """FPPDM: one SuperNode per domain, Wasserstein barycenter of the shared users."""
    from strategies.fppdm import WassersteinBarycenterStrategy

    if cfg.data.catalogue:  # deployment: the server never loads a domain's interactions
        cat = load_catalogue(cfg.data.catalogue)
        name, num_users, domains = cat["dataset"], int(cat["num_users"]), list(cat["domains"])
    else:
        ds = load_multidomain(cfg.data)
        name, num_users, domains = ds.name, ds.num_users, [d.name for d in ds.domains]
    log.info("FPPDM dataset %s: %d domains (%s), %d user ids; output %s", name, len(domains), ", ".join(domains),
             num_users, cfg.output_dir)
    recorder = RunRecorder(cfg.output_dir, cfg.algorithm, name, to_dict(cfg))
    strategy = WassersteinBarycenterStrategy(cfg, num_users, len(domains), recorder, domains)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=cfg.federation.rounds))


def trivial_components(cfg) -> ServerAppComponents:
    """The baseline job: FedAvg over an echoed vector, for Flower's own per-round overhead."""
    from clients.trivial import trivial_parameters
    from strategies.trivial import TimedFedAvg

    recorder = RunRecorder(cfg.output_dir, "trivial", cfg.data.name, to_dict(cfg))
    strategy = TimedFedAvg(recorder, cfg.federation.clients_per_round, cfg.federation.rounds,
                           trivial_parameters(cfg.trivial.payload_floats))
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=cfg.federation.rounds))


def secagg_fit_workflow(cfg, strategy):
    """Flower's SecAgg+ for the rounds that need it (user-level DP's training and evaluation rounds, each with its
    own per-coordinate range), Flower's plain fit workflow for the others (registration), dispatched by the
    strategy's own phase of each round."""
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.default_workflows import default_fit_workflow

    from fedrec_flwr.fedgnn.protocol import PHASE_EVALUATE_SUM
    from fedrec_flwr.fedgnn.user_dp import secagg_quantization_range
    from fedrec_flwr.flower.federation_size import user_nodes

    p = cfg.privacy
    per_node = 1 if cfg.data.catalogue else cfg.simulation.users_per_node
    nodes = strategy.bindings.num_users if cfg.data.catalogue else user_nodes(cfg)

    def secure(clipping_range: float) -> SecAggPlusWorkflow:
        return SecAggPlusWorkflow(num_shares=p.secagg_shares, reconstruction_threshold=p.secagg_threshold,
                                  max_weight=1.0, clipping_range=clipping_range,
                                  quantization_range=secagg_quantization_range(nodes),
                                  timeout=cfg.federation.round_timeout or None)

    train, evaluate = (secure(r) for r in strategy.rounds.mechanism.secagg_clipping_ranges(per_node))

    def fit(grid, context) -> None:
        """One fit round, secure or plain by the strategy's phase of it."""
        server_round = int(context.state.config_records["config"]["current_round"])
        if not strategy.is_secure_round(server_round):
            default_fit_workflow(grid, context)
        else:
            (evaluate if strategy.phase(server_round) == PHASE_EVALUATE_SUM else train)(grid, context)

    return fit


app = ServerApp()


@app.main()
def main(grid, context: Context) -> None:
    """Build the configured algorithm's strategy (`server_fn`), then run it: through Flower's DefaultWorkflow with
    SecAgg+ in the rounds whose phases its privacy mode sums securely (`secure_phases`), else as a plain strategy
    (Flower's compat path)."""
    from flwr.server import LegacyContext
    from flwr.server.compat import start_grid
    from flwr.server.workflow import DefaultWorkflow

    components = server_fn(context)
    cfg = from_run_config(context.run_config)
    with serverapp_pid_file(cfg.output_dir):
        strategy = components.strategy
        if getattr(strategy, "secure_phases", None):  # a strategy whose privacy mode sums some phases securely
            legacy = LegacyContext(context=context, config=components.config, strategy=strategy)
            DefaultWorkflow(fit_workflow=secagg_fit_workflow(cfg, strategy))(grid, legacy)
            return
        start_grid(server=components.server, config=components.config, strategy=components.strategy,
                   client_manager=components.client_manager, grid=grid)


PID_FILE = "serverapp.pid"


@contextmanager
def serverapp_pid_file(output_dir: str):
    """`<output_dir>/serverapp.pid` holds this ServerApp's process id while it runs (removed when it returns), so that
    whoever started the run can stop exactly its process, never another run's found by name."""
    path = Path(output_dir) / PID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
