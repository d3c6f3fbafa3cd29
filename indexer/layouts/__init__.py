"""Layouts (a single index is a layout of one part, a sharded one of a part per shard), the read side (`Index`), counts and evaluation."""
