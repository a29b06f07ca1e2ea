"""``ortmem stats``: run the model and record per-node memory (ORT's CSV format) (owned by ``ortmem.plan.estimate_cli``)."""
from .delegation import delegate

NAME = "stats"
HELP = "run the model and record per-node memory (ORT's CSV format)"
add_arguments, run = delegate("ortmem.plan.estimate_cli", "add_stats_arguments", "main_stats")
