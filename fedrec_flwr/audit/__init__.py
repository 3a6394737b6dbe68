"""Privacy audits: the attacks that the privacy benchmarks and tests run against the mechanisms, from the position
of the server or a colluder (they drive the cores the way a run does, so they sit above them)."""
