"""Benchmarks and reliability probes: each module a script, run from the repository root as
``python -m benchmarks.<name> --help``; figures go to BENCHMARKS.md, RELIABILITY.md and
benchmarks/RESULTS-*.md with the exact command.

They use product code only through the packages' public faces (the names in ``embedder``,
``indexer``, ``serving`` and ``training``'s ``__all__``; tests/test_architecture.py checks it),
so a benchmark measures what a user of the library gets.
"""
