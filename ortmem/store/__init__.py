"""The store: converted and finished cache entries, their folder format, keys, trust checks, digests and
pre-packed files, and the background finisher. See docs/architecture.md."""
