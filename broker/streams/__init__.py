"""rsb's streams in Redis: their keys, the Lua scripts of every change, the store that runs them and the records
it hands back, the replication level (when an event becomes visible), chats, the served models and the
aborted-generation report."""
