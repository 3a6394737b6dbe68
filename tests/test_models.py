"""Star-graph GNN models: shapes, gradients, batching equivalence, leak-free queries."""

import pytest
import torch

from fedrec_flwr.models.rating_gnn import RatingGNN
from fedrec_flwr.models.star_graph import build_star_batch


@pytest.mark.parametrize("kind", ["gat", "gcn", "ggnn"])
def test_forward_backward_shapes(kind):
    torch.manual_seed(0)
    d = 8
    model = RatingGNN(kind, d, dropout=0.2, bias_init=3.0)
    batch = build_star_batch([3, 2], [1, 2], [2, 0])
    user = torch.randn(2, d, requires_grad=True)
    items = torch.randn(5, d, requires_grad=True)
    query = torch.randn(3, d)
    neigh = torch.randn(2, d)
    pt, pq = model(batch, user, items, query, neigh)
    assert pt.shape == (5,) and pq.shape == (3,)
    (pt.sum() + pq.sum()).backward()
    assert user.grad.shape == (2, d) and items.grad.shape == (5, d)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kind", ["gat", "gcn", "ggnn"])
def test_batched_equals_one_user_at_a_time(kind):
    torch.manual_seed(1)
    d = 6
    model = RatingGNN(kind, d).eval()
    counts = [4, 1, 3]
    user = torch.randn(3, d)
    items = torch.randn(sum(counts), d)
    batched, _ = model(build_star_batch(counts), user, items)
    start, singles = 0, []
    for b, k in enumerate(counts):
        p, _ = model(build_star_batch([k]), user[b : b + 1], items[start : start + k])
        singles.append(p)
        start += k
    assert torch.allclose(batched, torch.cat(singles), atol=1e-5)


def test_query_items_do_not_change_the_user_representation():
    torch.manual_seed(2)
    model = RatingGNN("gat", 4).eval()
    user, items = torch.randn(1, 4), torch.randn(3, 4)
    without, _ = model(build_star_batch([3]), user, items)
    with_q, _ = model(build_star_batch([3], [2]), user, items, torch.randn(2, 4))
    assert torch.allclose(without, with_q, atol=1e-6)


def test_star_edges_neighbours_point_to_user_only():
    b = build_star_batch([2], [1], [3])
    ei = b.edge_index.numpy()
    neigh_nodes = set(range(1 + 2 + 1, 1 + 2 + 1 + 3))
    assert {int(s) for s, _ in ei.T if s in neigh_nodes} == neigh_nodes  # every neighbour sends an edge
    for s, t in ei.T:
        if s in neigh_nodes:
            assert t == 0
        assert t not in neigh_nodes


@pytest.mark.parametrize("kind", ["gat", "gcn", "ggnn"])
def test_biases_add_user_and_item_terms_read_from_the_raw_embeddings(kind):
    torch.manual_seed(3)
    d = 5
    plain = RatingGNN(kind, d, bias_init=3.0).eval()
    biased = RatingGNN(kind, d, bias_init=3.0, biases=True).eval()
    biased.load_state_dict({**plain.state_dict(), "user_bias_map": torch.randn(d), "item_bias_map": torch.randn(d)})
    batch = build_star_batch([3, 2], [2, 1])
    user, items, query = torch.randn(2, d), torch.randn(5, d), torch.randn(3, d)
    pt0, pq0 = plain(batch, user, items, query)
    pt1, pq1 = biased(batch, user, items, query)
    b_user = user @ biased.user_bias_map
    want_t = pt0 + b_user[batch.train_slot_user] + items @ biased.item_bias_map
    want_q = pq0 + b_user[batch.query_slot_user] + query @ biased.item_bias_map
    assert torch.allclose(pt1, want_t, atol=1e-5) and torch.allclose(pq1, want_q, atol=1e-5)
    # the bias vectors are shared model weights; the paper's model (biases off) has none of them
    assert len(list(biased.parameters())) == len(list(plain.parameters())) + 2


def test_biases_start_at_zero_so_a_new_model_predicts_as_the_paper_model():
    torch.manual_seed(4)
    plain = RatingGNN("gat", 4, bias_init=3.0).eval()
    torch.manual_seed(4)
    biased = RatingGNN("gat", 4, bias_init=3.0, biases=True).eval()
    batch = build_star_batch([3])
    user, items = torch.randn(1, 4), torch.randn(3, 4)
    assert torch.equal(plain(batch, user, items)[0], biased(batch, user, items)[0])


PYG_LAYERS = {"gat": lambda d: ("GATConv",
                                dict(in_channels=d, out_channels=d, heads=2, concat=False, add_self_loops=True)),
              "gcn": lambda d: ("GCNConv", dict(in_channels=d, out_channels=d, add_self_loops=True)),
              "ggnn": lambda d: ("GatedGraphConv", dict(out_channels=d, num_layers=1))}


@pytest.mark.parametrize("kind", ["gat", "gcn", "ggnn"])
def test_layer_weights_are_pygs_own_names_order_and_initial_draws(kind):
    """The weights the devices and the server hold without PyG are what PyG's layer holds: the same names in the
    same order and, from one seed, the same initial values and the same random stream after them (the same
    uniform draws with the same bounds, so equal exactly). PyG's layer over them (centralized training, the
    test oracle) draws nothing and computes with those very tensors."""
    import torch_geometric.nn as pyg

    from fedrec_flwr.models.star_layers import layer_weights, pyg_layer

    name, kwargs = PYG_LAYERS[kind](6)
    torch.manual_seed(3)
    reference, after_reference = getattr(pyg, name)(**kwargs), torch.rand(4)
    torch.manual_seed(3)
    ours, after_ours = layer_weights(kind, 6, heads=2), torch.rand(4)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in reference.named_parameters()]
    for (_, a), (_, b) in zip(ours.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b)
    assert torch.equal(after_ours, after_reference)
    torch.manual_seed(5)
    layer, drawn = pyg_layer(ours), torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(4))
    assert all(p is q for p, q in zip(layer.parameters(), ours.parameters()))
    x, edges = torch.randn(4, 6), torch.tensor([[1, 2, 3, 0], [0, 0, 0, 1]])
    assert torch.equal(layer(x, edges), reference(x, edges))


def test_device_and_server_processes_do_not_import_pyg():
    """A deployed SuperNode starts a ClientApp process per message: importing torch_geometric would add ~2.8 s of
    CPU to each (it imports torch._dynamo). The FedGNN device, its local step and evaluation, the server and the
    apps import torch only."""
    import subprocess
    import sys

    code = ("import sys, fedrec_flwr.flower.client_app, fedrec_flwr.flower.server_app, clients.fedgnn, strategies, "
            "fedrec_flwr.fedgnn.local_step, fedrec_flwr.fedgnn.server, fedrec_flwr.cli.inprocess, strategies.fedgnn; "
            "sys.exit('torch_geometric' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
