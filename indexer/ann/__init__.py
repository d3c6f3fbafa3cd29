"""The faiss side: index specs and k-means, the type chosen by measurement, tuning to a recall target, codes-only serving, DBA, the sharded plan (sample, train, fill)."""
