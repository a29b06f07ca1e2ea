"""``ortmem doctor``: installed onnxruntime, what ortmem may convert on it, cache health (paste into bug reports) (owned by ``ortmem.measure.doctor``)."""
from ortmem.cli.delegation import delegate

NAME = "doctor"
HELP = "installed onnxruntime, what ortmem may convert on it, cache health (paste into bug reports)"
add_arguments, run = delegate("ortmem.measure.doctor", "add_arguments", "main")
