"""Inputs the benchmarks and probes make, one copy each, which tests share: real container files,
damage inside an LMDB file, low-rank galleries, raw slow clients. Benchmarks cannot import tests
(tests/test_architecture.py), so what both need lives here; tests import nothing else of
benchmarks/ but the scripts they test."""
