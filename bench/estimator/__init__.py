"""bench.estimator: run its scripts as modules from the repository root (``python -m bench.estimator.SCRIPT``)."""
