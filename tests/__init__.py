"""ortmem's tests: a package, so test files and ``bench/`` import shared code as ``tests.support``
(pytest's default "prepend" import mode puts the repository root on ``sys.path``)."""
