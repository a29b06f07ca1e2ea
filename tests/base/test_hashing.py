"""ortmem.base.hashing: names derived from content, without hashlib (which loads OpenSSL)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import xxhash

from ortmem.base.hashing import MAX_LENGTH, short_hash


def test_a_name_is_xxh3_128_of_the_bytes_cut_to_length():
    blob = b'{"a": 1}'
    assert short_hash(blob) == xxhash.xxh3_128_hexdigest(blob) and len(short_hash(blob)) == MAX_LENGTH
    assert short_hash(blob, 24) == short_hash(blob)[:24] and short_hash(b"other") != short_hash(blob)
    with pytest.raises(ValueError):
        short_hash(blob, MAX_LENGTH + 1)


def test_naming_imports_no_hashlib():
    code = "import sys; from ortmem.base.hashing import short_hash; short_hash(b'x'); print('hashlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
