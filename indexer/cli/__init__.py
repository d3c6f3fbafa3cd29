"""``python -m indexer``: the argument parser and the commands, one module per group."""
