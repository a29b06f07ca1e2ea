"""Tests of ``ortmem.plan.recompute``."""
