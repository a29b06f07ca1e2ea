"""``ortmem stats``: run the model and record per-node memory (ORT's CSV format) (owned by ``ortmem.plan.estimate``)."""
from ortmem.cli.delegation import delegate

NAME = "stats"
HELP = "run the model and record per-node memory (ORT's CSV format)"
add_arguments, run = delegate("ortmem.plan.estimate", "add_stats_arguments", "main_stats")
