"""bench.distributed: run its scripts as modules from the repository root (``python -m bench.distributed.SCRIPT``)."""
