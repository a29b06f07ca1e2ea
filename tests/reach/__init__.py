"""Tests of ``ortmem.reach``."""
