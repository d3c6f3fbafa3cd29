"""Serving over HTTP: load against bare search, the per-read store check's cost
(docs/benchmarks/serving.md, RELIABILITY.md)."""
