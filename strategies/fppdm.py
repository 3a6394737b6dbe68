"""FPPDM's server behind Flower's Strategy API: a thin adapter over `fedrec_flwr.fppdm.rounds`.

Every round all domains train and upload (global user ids, mu, sigma) of their users; the round
core validates each upload, computes the closed-form W2 barycenter per user over the domains where
it appears (if at least `federation.min_clients` uploads were accepted), and sends each domain the
global distributions of its own users. This class adds only what Flower needs: FitIns/EvaluateIns,
waiting for the domains' SuperNodes, and the end of the run.
"""

from __future__ import annotations

import time

from flwr.common import EvaluateIns, FitIns, ndarrays_to_parameters
from flwr.server.strategy import Strategy

from fedrec_flwr.config import AppConfig
from fedrec_flwr.fppdm.rounds import FPPDMRounds
from fedrec_flwr.messages import NodeReply
from fedrec_flwr.reporting.results import RunRecorder, records_failure
from strategies.nodes import check_domain_nodes, decode_replies, wait_for_nodes


class WassersteinBarycenterStrategy(Strategy):
    """Aggregates per-user diagonal Gaussians by their W2 barycenter (FPPDM)."""

    def __init__(self, cfg: AppConfig, num_users: int, num_domains: int, recorder: RunRecorder | None = None,
                 domain_names: list[str] | None = None):
        self.cfg, self.num_domains = cfg, num_domains
        self.recorder = recorder
        self.rounds = FPPDMRounds.from_config(cfg, num_users, recorder, num_domains, domain_names)
        self.round_started = time.time()

    @property
    def num_rounds(self) -> int:
        """Flower rounds of the run."""
        return self.cfg.federation.rounds

    def initialize_parameters(self, client_manager):
        """Nothing global exists before the first round."""
        return ndarrays_to_parameters([])

    @records_failure
    def configure_fit(self, server_round, parameters, client_manager):
        """Every domain trains every round, towards the global distributions of its own users."""
        self.round_started = time.time()
        if server_round == 1:
            if self.cfg.data.catalogue:  # deployment: domains connect in their own time; wait for all of them
                wait_for_nodes(client_manager, self.num_domains, self.cfg.deployment.node_wait_seconds)
            else:  # simulation: the federation is what it is; one SuperNode per domain, or stop now
                check_domain_nodes(len(client_manager.all()), self.num_domains)
        return [(c, FitIns(ndarrays_to_parameters(self.rounds.download(c.node_id)), {"round": server_round}))
                for c in client_manager.all().values()]

    @records_failure
    def aggregate_fit(self, server_round, results, failures):
        """Hand the uploads to the round core; rejected ones are logged and counted, never averaged in."""
        replies = decode_replies(results, lambda why: self.rounds.reject(server_round, why))
        record = self.rounds.train(server_round, replies, [str(f) for f in failures], self.round_started)
        return ndarrays_to_parameters([]), {k: v for k, v in record.items() if isinstance(v, (int, float))}

    @records_failure
    def configure_evaluate(self, server_round, parameters, client_manager):
        """Every `eval_every` rounds and at the end, all domains evaluate."""
        if not self.rounds.is_eval_round(server_round):
            return []
        return [(c, EvaluateIns(ndarrays_to_parameters([]), {"round": server_round}))
                for c in client_manager.all().values()]

    @records_failure
    def aggregate_evaluate(self, server_round, results, failures):
        """Per-domain HR/NDCG and their unweighted mean over domains."""
        replies = [NodeReply(proxy.node_id, metrics=dict(res.metrics)) for proxy, res in results]
        mean = self.rounds.evaluate(server_round, replies)
        if server_round == self.num_rounds:
            self.rounds.finish()
        return None, ({} if mean is None else mean)

    def evaluate(self, server_round, parameters):
        """The server holds no data to evaluate on."""
        return None
