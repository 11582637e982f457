"""Redis plumbing: the only package of rsb that imports redis-py. Clients (standalone, Cluster, Sentinel) and
the one predicate for "Redis is away" (connection), rsb's keyspace and its partitions' hash tags (keyspace),
many channels over few pub/sub connections (pubsub), writes that wait for replicas (replicas), and a private
redis-server process (server)."""
