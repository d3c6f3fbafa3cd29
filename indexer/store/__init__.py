"""The gallery store: the LMDB environment, the store's key layout, walking a gallery, ingest (read, dedupe, embed, commit), vector sources."""
