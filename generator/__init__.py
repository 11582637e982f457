"""Generator workers: claim jobs from Redis, run inference, append events to the stream."""
