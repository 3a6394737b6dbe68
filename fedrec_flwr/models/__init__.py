"""The models: the FedGNN rating GNNs, PyG's layers held and run without importing PyG on the federated path
(`rating_gnn`, `star_layers`, `dense_star`; `star_graph` for PyG's own message passing) and
FPPDM's Gaussian LightGCN (`gaussian_gcn`, plain torch and scipy). The package imports none of them, so
a process loads only the model it uses."""
