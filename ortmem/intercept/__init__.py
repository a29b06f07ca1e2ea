"""Unmodified programs through ortmem: the process-wide hook (``session_hook``: ``ortmem.hook()``), ``python -m
ortmem run`` (``launcher``, ``hook_options``, ``site/``, ``plain_run``) and the guard against a shadowing
``ortmem`` folder (``own_package``). Named ``intercept`` because ``ortmem.hook`` is the public function."""
