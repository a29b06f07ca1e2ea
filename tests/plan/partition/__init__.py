"""Tests of ``ortmem.plan.partition``."""
