"""The indexer on one machine: the index type by measurement, ingest, the Ray build, DBA
re-ranking, two checkouts' build and search speed (docs/benchmarks/indexer.md)."""
