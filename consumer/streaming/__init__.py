"""Serving streams: the one stream service every view uses (service), a reader's replay-then-tail (reader), the
pod's live fan-out over one pub/sub connection (hub), the pod's one heartbeat clock (clock), and the one SSE
response (sse)."""
