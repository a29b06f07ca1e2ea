"""Tests of ``ortmem.ortmodel``."""
