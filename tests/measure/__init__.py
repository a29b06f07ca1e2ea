"""Tests of ``ortmem.measure``."""
