"""The Flower layer: the ServerApp and ClientApp entry points, how a simulated federation is sized, the
app's staged files for `flwr run`, and this user's local SuperLink. Flower's adapters proper are the
project's top-level `strategies/` and `clients/` folders, which these apps build."""
