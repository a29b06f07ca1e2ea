"""Tests of ``ortmem.plan.estimate``."""
