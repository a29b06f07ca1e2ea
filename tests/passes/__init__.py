"""Tests of ``ortmem.passes``."""
