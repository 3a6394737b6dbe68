"""Flower strategies: FedAvg with pseudo-item gradient merging, Wasserstein barycenter."""
