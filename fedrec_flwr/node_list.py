"""The operator's node list: which authenticated SuperNode speaks for which users (FedGNN) or domain (FPPDM).

A JSON object {node id: [ids]}, written from the node ids that `flwr supernode register --format json`
printed for each device's key (config key `deployment.node_list`). Every part is checked as it is read:
node ids are decimal integers in [0, 2**64) (Flower's), each named once; each value is a list of
integer ids in [0, num_ids), each id listed for one node only; a list naming no node is refused (no
device could register).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MAX_NODE_ID = 2**64 - 1  # Flower's node ids are unsigned 64-bit integers
_DECIMAL = re.compile(r"[0-9]+")


class NodeListError(ValueError):
    """A node list file that cannot be used; the message names the file and what was expected."""


class _Pairs(list):
    """A JSON object as its (key, value) pairs: repeated keys kept, which a dict would collapse to the last."""


def load_node_list(path: str | Path, num_ids: int) -> dict[int, frozenset[int]]:
    """{node id: its users (FedGNN) or its domain index (FPPDM)} from the operator's JSON node list,
    checked: every id in [0, num_ids) and listed for one node only."""
    path = Path(path)
    where = f"deployment.node_list {path}"
    expected = "expected a JSON object {node id: [user ids or domain index]}"
    if not path.is_file():
        raise NodeListError(f"{where}: {'not a file' if path.exists() else 'no such file'}; {expected}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_Pairs)
    except UnicodeDecodeError as exc:
        raise NodeListError(f"{where}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                            f"{expected}") from None
    except json.JSONDecodeError as exc:
        raise NodeListError(f"{where}: not JSON (line {exc.lineno}, column {exc.colno}: "
                            f"{exc.msg}); {expected}") from None
    except OSError as exc:
        raise NodeListError(f"{where}: cannot be read ({exc.strerror}); {expected}") from None
    if not isinstance(raw, _Pairs):
        kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(raw), "number")
        raise NodeListError(f"{where}: a JSON {kind}; {expected}")
    if not raw:
        raise NodeListError(f"{where}: lists no node; {expected} naming at least one node (no device could register)")
    listing: dict[int, frozenset[int]] = {}
    seen: dict[int, int] = {}
    for key, users in raw:
        if not _DECIMAL.fullmatch(key) or int(key) > MAX_NODE_ID:
            raise NodeListError(f"{where}: node id {key!r}; expected a decimal integer in [0, 2**64) "
                                "(as `flwr supernode register --format json` prints it)")
        node = int(key)
        if node in listing:
            raise NodeListError(f"{where}: node {node} is named twice; expected each node once")
        if isinstance(users, _Pairs) or not isinstance(users, list) or not all(type(u) is int for u in users):
            shown = json.dumps(dict(users) if isinstance(users, _Pairs) else users)
            raise NodeListError(f"{where}: node {node} lists {shown[:80]}; expected a list of integer ids")
        for u in users:
            if not 0 <= u < num_ids:
                raise NodeListError(f"{where}: node {node} lists id {u}, outside [0, {num_ids})")
            if seen.get(u) == node:
                raise NodeListError(f"{where}: node {node} lists id {u} twice; expected each id once")
            if u in seen:
                raise NodeListError(f"{where}: id {u} is listed for nodes {seen[u]} and {node}")
            seen[u] = node
        listing[node] = frozenset(users)
    return listing
