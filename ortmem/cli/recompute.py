"""``ortmem recompute``: lower the activation peak: recompute cheap tensors, reorder nodes (owned by ``ortmem.plan.recompute``)."""
from ortmem.cli.delegation import delegate

NAME = "recompute"
HELP = "lower the activation peak: recompute cheap tensors, reorder nodes"
add_arguments, run = delegate("ortmem.plan.recompute", "add_recompute_arguments", "main_recompute")
