"""Embedders: the training-free default and its int8 recipes, onnxruntime against torch, timm
backbones, preprocessing and decode cost and memory (docs/benchmarks/embedder.md,
docs/benchmarks/quality-round5.md)."""
