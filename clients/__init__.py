"""Flower NumPyClients: one FedGNN user, one FPPDM domain."""
