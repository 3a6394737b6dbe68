"""FedGNN (Wu et al., "FedGNN: Federated Graph Neural Network for Privacy-Preserving Recommendation"):
the wire protocol, the user-device core, the server core and the transport-agnostic round core."""
