"""Ray: the one owner of the connection helpers, the shards' reader actors, and the fan-out that serves a sharded index across nodes."""
