"""Benchmarks and reliability probes: each module a script, run from the repository root as
``python -m benchmarks.<area>.<name> --help``; areas: training, embedder, indexer, serving,
scaling, reliability; inputs holds what they make that tests share. At the top: the lent GPU's
gpu_check, device_suite (and device_prep.sh) and the gallery audit's audit_faults. A run prints
its table; ``--out``/``--results PATH`` also writes it (bench_out/ is git-ignored). Kept figures,
with the exact command: BENCHMARKS.md (the goals), docs/benchmarks/<area>.md and RELIABILITY.md.

They use product code only through the packages' public faces (the names in ``embedder``,
``indexer``, ``serving`` and ``training``'s ``__all__``; tests/test_architecture.py checks it),
so a benchmark measures what a user of the library gets.
"""
