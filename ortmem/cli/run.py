"""``ortmem run``: run an unmodified Python program with every ORT session it creates going through ortmem (owned by ``ortmem.intercept.launcher``)."""
from ortmem.cli.delegation import delegate

NAME = "run"
HELP = "run an unmodified Python program with every ORT session it creates going through ortmem"
add_arguments, run = delegate("ortmem.intercept.launcher", "add_arguments", "main")
