"""The models: the FedGNN rating GNNs on PyTorch Geometric (`rating_gnn`, `star_graph`, `dense_star`) and
FPPDM's Gaussian LightGCN (`gaussian_gcn`, plain torch and scipy). The package imports none of them, so
a process loads only the model it uses."""
