"""``python -m ortmem``: the ``ortmem`` command (every subcommand, ``run`` included)."""
import sys

from .cli import main

sys.exit(main())
