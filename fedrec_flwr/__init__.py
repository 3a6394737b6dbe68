"""fedrec-flwr: federated graph-neural-network recommenders on Flower (FedGNN, FPPDM). The layers, from the bottom:

- the base: `config`, the registries (`algorithms`, `privacy_modes`), `messages`, `metrics`, `fsutil`, and the
  `data`, `models`, `privacy` and `neighbours` packages;
- the reference and reporting: `reference` (the centralized model and baselines), `reporting` (what a run writes);
- the Flower-free cores: `fedgnn` (with its privacy `modes`) and `fppdm`;
- Flower: `flower` (the apps), over the project's top-level `strategies/` and `clients/` adapters;
- the front end: `cli` (the `fedrec` command, the run driver, the in-process runner) and `deployment` (per-node files).

Arrows point down only (tests/test_import_graph.py); docs/architecture.md traces one round through them.
"""
