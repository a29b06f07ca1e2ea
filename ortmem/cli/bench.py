"""``ortmem bench``: measure session creation (memory, time) per strategy, each in fresh processes (owned by ``ortmem.measure.bench``)."""
from ortmem.cli.delegation import delegate

NAME = "bench"
HELP = "measure session creation (memory, time) per strategy, each in fresh processes"
add_arguments, run = delegate("ortmem.measure.bench", "add_arguments", "main")
