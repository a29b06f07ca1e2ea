"""``ortmem run``: run an unmodified Python program with every ORT session it creates going through ortmem (owned by ``ortmem.reach.launcher``)."""
from .delegation import delegate

NAME = "run"
HELP = "run an unmodified Python program with every ORT session it creates going through ortmem"
add_arguments, run = delegate("ortmem.reach.launcher", "add_arguments", "main")
