"""What the strategies share about nodes: waiting for deployed SuperNodes, and decoding their replies."""

from __future__ import annotations

from typing import Callable

from flwr.common import parameters_to_ndarrays

from fedrec_flwr.messages import NodeReply


def wait_for_nodes(client_manager, count: int, timeout: float) -> None:
    """Block until `count` nodes are connected; RuntimeError naming the shortfall after `timeout` seconds."""
    if count > 0 and len(client_manager.all()) < count and not client_manager.wait_for(count, timeout=int(timeout)):
        raise RuntimeError(f"only {len(client_manager.all())} of the {count} expected SuperNodes connected "
                           f"within {timeout:.0f}s (deployment.node_wait_seconds)")


class FederationSizeError(RuntimeError):
    """A simulated federation of the wrong size for the run (the message names the size it needs)."""


def check_domain_nodes(nodes: int, domains: int) -> None:
    """FederationSizeError unless a simulated FPPDM federation has one SuperNode per domain, naming the count and the
    command that sets it: with fewer, some domains would never train; with more, the extra ones have no domain."""
    if nodes != domains:
        raise FederationSizeError(
            f"{nodes} SuperNodes for the dataset's {domains} domains; FPPDM runs one per domain: flwr run . "
            f"--federation-config \"num-supernodes={domains}\" (or fedrec run, which sizes the federation)")


def decode_replies(results, reject: Callable[[str], None]) -> list[NodeReply]:
    """Each fit result as a NodeReply; a reply whose arrays cannot be decoded (pickled objects, garbage
    bytes, oversized headers) is rejected with its reason instead of ending the run."""
    replies = []
    for proxy, res in results:
        try:
            replies.append(NodeReply(proxy.node_id, parameters_to_ndarrays(res.parameters)))
        except (ValueError, TypeError, OSError, EOFError) as exc:
            reject(f"node {proxy.node_id}: undecodable upload ({type(exc).__name__}: {exc})"[:300])
    return replies
