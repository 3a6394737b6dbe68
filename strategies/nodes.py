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
