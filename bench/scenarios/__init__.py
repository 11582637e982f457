"""One module per scenario; each has ``add_args(parser)`` and ``run(args) -> dict`` (the JSON result)."""

SCENARIOS = ["latency", "capacity", "throughput", "resume", "generator", "cpu", "peer", "create", "soak", "aisdk",
             "durable", "durability", "constrained"]
