"""Tests of ``ortmem.handoff``."""
