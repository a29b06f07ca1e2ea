"""bench.recompute: run its scripts as modules from the repository root (``python -m bench.recompute.SCRIPT``)."""
