"""Durable Streams in Redis (the open protocol at ``/v1/stream/``: streams that clients name and write): their
keys, Lua scripts, store and stored format."""
