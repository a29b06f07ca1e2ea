"""``ortmem partition``: split a model over devices with memory budgets (stages + plan.json) (owned by ``ortmem.plan.partition``)."""
from ortmem.cli.delegation import delegate

NAME = "partition"
HELP = "split a model over devices with memory budgets (stages + plan.json)"
add_arguments, run = delegate("ortmem.plan.partition", "add_partition_arguments", "main_partition")
