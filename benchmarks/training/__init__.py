"""Training and DAS: baseline vs DAS on Omniglot and real photos (paired seeds), frozen features,
what DAS costs and where it puts its copies (docs/benchmarks/training-das.md)."""
