"""Tests of ``ortmem.distributed``."""
