"""The store: converted and finished cache entries, their folder format, keys, trust checks, digests and
pre-packed files, and the background packer. See docs/architecture.md."""
