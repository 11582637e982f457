"""One module per scenario; each has ``add_args(parser)`` and ``run(args) -> dict`` (the JSON result). A
scenario's name is its module's, with ``-`` for ``_`` (``partial-json`` is partial_json.py)."""

SCENARIOS = ["latency", "capacity", "throughput", "resume", "generator", "cpu", "peer", "create", "soak", "aisdk",
             "durable", "durability", "partial-json", "conversation", "constrained",
             "reconnect", "chat", "fairness", "concurrency", "users", "determinism", "faults"]
