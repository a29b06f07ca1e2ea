"""Tests of ``ortmem.store``."""
