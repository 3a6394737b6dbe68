"""Graph expansion: keyed tokens, the neighbour service's matching and refusals, client failures."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from fedrec_flwr.data.synthetic import make_synthetic
from fedrec_flwr.neighbours import (
    NeighbourClient, NeighbourService, NeighbourServiceError, RequestError, item_tokens, new_handle, new_run_key, serve,
)


@pytest.fixture
def service():
    httpd, thread = serve("127.0.0.1", 0)
    yield httpd, f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _users(n=40, seed=0):
    ds = make_synthetic(seed=seed, num_users=n, num_items=60, mean_degree=6)
    return [np.unique(ds.train.items[ds.train.users == u]) for u in range(n)]


def test_matching_equals_brute_force(service):
    _, address = service
    key, dim = new_run_key(), 4
    users = _users()
    client = NeighbourClient(address)
    client.open_run("r1", dim, 100, 1000)
    handles = [new_handle() for _ in users]
    embs = np.random.default_rng(0).standard_normal((len(users), dim)).astype(np.float32)
    for h, items, e in zip(handles, users, embs):
        client.submit("r1", h, e, item_tokens(key, items))
    for u, h in enumerate(handles):
        got = {tuple(np.round(row, 5)) for row in client.neighbours("r1", h)}
        expected = {tuple(np.round(embs[v], 5)) for v in range(len(users))
                    if v != u and np.intersect1d(users[u], users[v]).size}
        assert got == expected


def test_neighbour_cap_prefers_most_shared_items():
    svc = NeighbourService()
    svc.open_run("r", 2, 10, 1)
    svc.submit("r", "a" * 32, [0, 0], ["1" * 32, "2" * 32])
    svc.submit("r", "b" * 32, [1, 1], ["1" * 32])
    svc.submit("r", "c" * 32, [2, 2], ["1" * 32, "2" * 32])
    assert svc.neighbours("r", "a" * 32).tolist() == [[2.0, 2.0]]


def test_user_never_receives_its_own_embedding():
    svc = NeighbourService()
    svc.open_run("r", 3, 10, 10)
    svc.submit("r", "a" * 32, [9, 9, 9], ["1" * 32])
    assert svc.neighbours("r", "a" * 32).shape == (0, 3)  # alone: nothing, not itself
    svc.submit("r", "b" * 32, [1, 2, 3], ["1" * 32])
    assert svc.neighbours("r", "a" * 32).tolist() == [[1, 2, 3]]
    assert svc.neighbours("r", "b" * 32).tolist() == [[9, 9, 9]]


def test_tokens_under_another_key_share_nothing_and_service_holds_no_key(service, monkeypatch):
    _, address = service
    key, items = new_run_key(), np.arange(500)
    real, other = item_tokens(key, items), item_tokens(new_run_key(), items)
    assert len(set(real)) == 500 and not set(real) & set(other)
    sent: list[str] = []
    original = NeighbourClient._post
    monkeypatch.setattr(NeighbourClient, "_post", lambda self, path, body: sent.append(json.dumps(body)) or original(self, path, body))
    client = NeighbourClient(address)
    client.open_run("k", 2, 600, 5)
    client.submit("k", new_handle(), np.zeros(2), real)
    assert sent and not any(key.hex() in s or str(list(key)) in s for s in sent)  # the key never goes out
    assert not any(str(int(i)) in json.loads(sent[-1])["tokens"] for i in items[:20])  # nor item ids
    with pytest.raises(ValueError, match="128 bits"):
        item_tokens(b"short", items)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: s.submit("r", "a" * 32, [0, 0], ["xyz"]), "malformed token"),
        (lambda s: s.submit("r", "a" * 32, [0, 0], ["1" * 32] * 6), "too many tokens: 6 > limit 5"),
        (lambda s: s.submit("r", "not-a-handle", [0, 0], ["1" * 32]), "handle must be"),
        (lambda s: s.submit("r", "a" * 32, [0, float("nan")], ["1" * 32]), "2 finite numbers"),
        (lambda s: s.submit("nope", "a" * 32, [0, 0], ["1" * 32]), "unknown run 'nope'"),
        (lambda s: s.neighbours("nope", "a" * 32), "unknown run 'nope'"),
    ],
)
def test_bad_requests_are_refused_with_clear_errors(call, message):
    svc = NeighbourService()
    svc.open_run("r", 2, 5, 3)
    with pytest.raises(RequestError, match=message):
        call(svc)


def test_http_refusal_reaches_the_client_verbatim(service):
    _, address = service
    client = NeighbourClient(address, retries=0)
    with pytest.raises(NeighbourServiceError, match="refused /runs/ghost/submit: unknown run 'ghost'"):
        client.submit("ghost", new_handle(), np.zeros(2), ["1" * 32])
    req = urllib.request.Request(f"http://{address}/runs", data=b"[1,2]")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert json.loads(err.value.read())["error"] == "request body must be a JSON object"


def test_unreachable_service_fails_after_configured_retries():
    client = NeighbourClient("127.0.0.1:9", retries=2, backoff_s=0.01, timeout_s=1)
    with pytest.raises(NeighbourServiceError, match="unreachable after 3 attempts"):
        client.open_run("r", 2, 5, 3)


def test_restart_mid_expansion_is_an_error_not_a_half_expanded_graph():
    httpd, _ = serve("127.0.0.1", 0)
    port = httpd.server_address[1]
    client = NeighbourClient(f"127.0.0.1:{port}", retries=0)
    client.open_run("r", 2, 5, 3)
    handle = new_handle()
    client.submit("r", handle, np.zeros(2), ["1" * 32])
    httpd.shutdown()
    httpd.server_close()
    restarted, _ = serve("127.0.0.1", port)  # same address, fresh state
    try:
        with pytest.raises(NeighbourServiceError, match="unknown run 'r' \\(not opened, or the service restarted\\)"):
            client.neighbours("r", handle)
    finally:
        restarted.shutdown()
