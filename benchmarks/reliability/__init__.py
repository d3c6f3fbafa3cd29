"""The hostile-but-fair probes: ``python -m benchmarks.reliability.probes`` runs them all against a
real ``python app.py``, one table row each (RELIABILITY.md)."""
