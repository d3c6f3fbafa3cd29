"""Past one machine: the driver's walk, the streaming build and its plan, k-means at many lists,
codes-only and memory-mapped serving, the Ray fan-out, per-image inputs for docs/SCALING.md
(docs/benchmarks/scaling.md)."""
