"""Node availability shared by the strategies: deployed SuperNodes connect in their own time."""

from __future__ import annotations


def wait_for_nodes(client_manager, count: int, timeout: float) -> None:
    """Block until `count` nodes are connected; RuntimeError naming the shortfall after `timeout` seconds."""
    if count > 0 and len(client_manager.all()) < count and not client_manager.wait_for(count, timeout=int(timeout)):
        raise RuntimeError(f"only {len(client_manager.all())} of the {count} expected SuperNodes connected "
                           f"within {timeout:.0f}s (deployment.node_wait_seconds)")
