"""What the generator and the consumer share: key schema, events, atomic operations, settings, client."""
