"""FedGNN's privacy modes, one module each (registered in `fedrec_flwr.privacy_modes`): `ldp` (the paper's pseudo
items and per-coordinate local DP) and `user_dp` (user-level DP on SecAgg+ sums); `base` holds the interfaces."""
