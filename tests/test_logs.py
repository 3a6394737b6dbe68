"""The console of a run: Flower's own per-round lines and History dump are filtered unless asked for."""

from __future__ import annotations

import inspect
import logging

import pytest
from flwr.app import RecordDict
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerConfig
from flwr.server import server as flower_server
from flwr.server.client_manager import SimpleClientManager
from flwr.server.strategy import Strategy

from fedrec_flwr.config import ConfigError, load_config
from fedrec_flwr.flower.server_app import server_fn
from fedrec_flwr.reporting.logs import FLOWER_ROUND_MESSAGES, FlowerRoundFilter, show_flower_round_logs


class _NoClients(Strategy):
    """Selects nobody but scores every round centrally: Flower logs its round headers, the skipped
    fit/evaluate, its "fit progress" and, at the end, the History of those scores."""

    def initialize_parameters(self, client_manager):
        return ndarrays_to_parameters([])

    def configure_fit(self, server_round, parameters, client_manager):
        return []

    def aggregate_fit(self, server_round, results, failures):
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return 0.5, {"score": 1.0}


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def flower_lines():
    """The messages Flower's logger hands to its handlers; the filter's state is restored afterwards."""
    flower, handler = logging.getLogger("flwr"), _Collect()
    before = list(flower.filters)
    flower.addHandler(handler)
    yield handler.records
    flower.removeHandler(handler)
    flower.filters[:] = before


def _run_flower(rounds: int = 2) -> None:
    server = flower_server.Server(client_manager=SimpleClientManager(), strategy=_NoClients())
    flower_server.run_fl(server, ServerConfig(num_rounds=rounds))


def test_flowers_round_lines_and_history_dump_are_dropped_by_default(flower_lines):
    show_flower_round_logs(False)
    _run_flower()
    shown = [r.getMessage() for r in flower_lines]
    assert not any(m.startswith(("[ROUND", "configure_", "fit progress", "[SUMMARY]", "\t")) or m == ""
                   for m in shown), shown
    assert any(m.startswith("Run finished 2 round(s)") for m in shown)  # one line at the end stays
    flower_lines.clear()
    show_flower_round_logs(True)  # simulation.flower_logs=true: Flower's own lines again
    _run_flower()
    shown = [r.getMessage() for r in flower_lines]
    assert "[ROUND 2]" in shown and "configure_fit: no clients selected, cancel" in shown and "[SUMMARY]" in shown
    assert "\tHistory (loss, centralized):" in shown and any(m.startswith("fit progress") for m in shown)


def test_the_filtered_templates_are_flowers_own_and_warnings_always_pass():
    """Every template is in flwr/server/server.py as written (a Flower upgrade that rewords one fails here)."""
    source = inspect.getsource(flower_server)
    for message in FLOWER_ROUND_MESSAGES - {""}:
        assert f'"{message.encode("unicode_escape").decode()}"' in source, message
    keep = FlowerRoundFilter()
    record = logging.LogRecord("flwr", logging.WARNING, __file__, 1, "[ROUND %s]", (3,), None)
    assert keep.filter(record)
    record = logging.LogRecord("flwr", logging.INFO, __file__, 1, "[ROUND %s]", (3,), None)
    assert not keep.filter(record)
    record = logging.LogRecord("flwr", logging.INFO, __file__, 1, "Starting Flower ServerApp, config: %s", ("x",), None)
    assert keep.filter(record)


def test_the_server_app_installs_the_filter_per_config(tmp_path, flower_lines):
    flower = logging.getLogger("flwr")
    run_config = {"preset": "trivial", "dataset": "synthetic", "output-dir": str(tmp_path / "out"),
                  "cache-dir": str(tmp_path / "cache")}
    for shown, extra in ((False, {}), (True, {"set": "simulation.flower_logs=true"}), (False, {})):
        server_fn(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={**run_config, **extra}))
        assert any(isinstance(f, FlowerRoundFilter) for f in flower.filters) is not shown
    assert load_config("fedgnn_paper").simulation.flower_logs is False
    with pytest.raises(ConfigError, match="simulation.flower_logs"):
        load_config("fedgnn_paper", None, ["simulation.flower_logs=maybe"])
