"""``ortmem estimate``: predict session-creation and activation memory from metadata alone (owned by ``ortmem.plan.estimate``)."""
from ortmem.cli.delegation import delegate

NAME = "estimate"
HELP = "predict session-creation and activation memory from metadata alone"
add_arguments, run = delegate("ortmem.plan.estimate", "add_estimate_arguments", "main_estimate")
