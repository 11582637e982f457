"""Subscribing to many channels over few connections, on a standalone server or a Redis Cluster.

Standalone: one pub/sub connection (SUBSCRIBE) carries every channel. Redis Cluster: channels are
sharded (the scripts SPUBLISH them, see broker.streams.scripts) and SSUBSCRIBE only works on the master that
owns the channel's slot, so there is one connection per master that owns at least one subscribed
channel: never more connections than masters, however many channels.

The owner of a ``Channels`` (channels) gets three things: messages (``on_message``), confirmations (the future
``subscribe`` returns resolves once Redis acknowledged the subscription, so anything published after
that is delivered), and resets (``on_reset``): channels whose messages may have been lost (the connection
dropped, or the slot moved to another master) and which are subscribed again; a reset is reported twice,
when the loss is seen and once the new subscription is confirmed, so whoever re-reads the source of truth
at the second report misses nothing.

The modules: ``channels`` routes each channel to a connection (and moves channels when a cluster's slots move);
``shard`` is one connection's life (connect, subscribe again, confirmations, the server dropping a channel,
reconnect); ``dispatch`` reads its replies (raw through hiredis, or through redis-py) and hands messages on;
``liveness`` pings a quiet connection and declares a silent one dead (DEAD_AFTER_S), to be made again.
"""
