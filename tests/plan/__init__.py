"""Tests of ``ortmem.plan``."""
