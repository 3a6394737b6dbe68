"""The centralized reference (no federation, no privacy) and the trivial baselines every model is scored
against on the same ratings."""
