"""The index directory: every file name, the typed manifest, the writer lock, file checks, the model file."""
