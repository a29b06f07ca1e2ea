"""``ortmem doctor``: installed onnxruntime, what ortmem may convert on it, cache health (paste into bug reports) (owned by ``ortmem.doctor``)."""
from .delegation import delegate

NAME = "doctor"
HELP = "installed onnxruntime, what ortmem may convert on it, cache health (paste into bug reports)"
add_arguments, run = delegate("ortmem.doctor", "add_arguments", "main")
