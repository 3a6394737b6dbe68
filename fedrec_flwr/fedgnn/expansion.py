"""The recommendation server's side of graph expansion: open a run at the neighbour service, hand clients the link."""

from __future__ import annotations

import logging
import os
import secrets

from fedrec_flwr.fedgnn.protocol import ExpansionLink
from fedrec_flwr.neighbours.cli import ADMIN_TOKEN_ENV
from fedrec_flwr.neighbours.client import NeighbourClient, NeighbourServiceError
from fedrec_flwr.neighbours.process import start_local_service
from fedrec_flwr.neighbours.tokens import new_run_key

log = logging.getLogger(__name__)


def open_expansion_link(cfg, num_items: int) -> ExpansionLink:
    """Key material for the clients, and a run opened at the neighbour service (started on loopback unless
    configured) with the operator's admin token; the run's secret goes to the clients, the token does not.
    Used by the ServerApp and by the in-process runner alike."""
    exp = cfg.expansion
    address = exp.service_address
    if address:
        token = (open(exp.service_token_file, encoding="utf-8").read() if exp.service_token_file
                 else os.environ.get(ADMIN_TOKEN_ENV, "")).strip()
        if not token:
            raise ValueError(f"expansion.service_address is set but no admin token: set expansion.service_token_file "
                             f"or ${ADMIN_TOKEN_ENV}")
    else:
        address, _, token = start_local_service()
        log.info("neighbour service started on %s", address)
    admin = NeighbourClient(address, retries=exp.retries, token=token, ca_file=exp.ca_file or None)
    run_id = secrets.token_hex(8)
    # trainable expansion re-submits every round, and fixed expansion with refresh_every every k rounds
    secret = admin.open_run(run_id, cfg.model.dim, max_tokens=num_items, max_neighbours=exp.max_neighbours,
                            updates=exp.mode == "trainable" or exp.refresh_every > 0, match=exp.match)

    def close_run() -> None:
        """Called when the run ends: the service forgets its embeddings now, not at the TTL."""
        try:
            admin.close_run(run_id)
        except NeighbourServiceError as exc:  # it expires on its own; the finished run stands
            log.warning("could not close the neighbour-service run: %s", exc)

    return ExpansionLink(new_run_key(), address, run_id, secret, close_run)
