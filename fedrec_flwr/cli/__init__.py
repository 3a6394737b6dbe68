"""The front end: the `fedrec` command (`commands`), the run driver (`runner`: `flwr run` or the centralized
reference), the in-process runner, sweeps, and each algorithm's checks before a run starts (`preflight`)."""
