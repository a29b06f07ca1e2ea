"""``python -m ortmem``: the ``ortmem`` command (every subcommand, ``run`` included)."""
import sys

from ortmem.cli import main

if __name__ == "__main__":  # not when multiprocessing's spawn imports it as __mp_main__
    sys.exit(main())
