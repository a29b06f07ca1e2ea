"""bench.partition: run its scripts as modules from the repository root (``python -m bench.partition.SCRIPT``)."""
