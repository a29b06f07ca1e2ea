"""ortmem.base.logs: the hook's modules log without importing logging until a record can be seen."""
from __future__ import annotations

import logging
import subprocess
import sys

from ortmem.base import logs


def test_a_debug_record_imports_nothing_and_a_warning_reaches_logging():
    code = ("import sys; from ortmem.base import logs; logs.debug('ortmem.x', 'unseen %d', 1); a = 'logging' in sys.modules; "
            "logs.warning('ortmem.x', 'seen %d', 2); print(a, 'logging' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True"]
    assert done.stderr.strip() == "seen 2"  # logging's last-resort handler, as for any unconfigured logger


def test_records_go_to_the_named_logger_at_their_level(caplog):
    with caplog.at_level(logging.DEBUG, logger="ortmem.test_logs"):
        logs.debug("ortmem.test_logs", "a %s", "debug")
        logs.warning("ortmem.test_logs", "a %s", "warning")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("ortmem.test_logs", logging.DEBUG, "a debug"), ("ortmem.test_logs", logging.WARNING, "a warning")]
