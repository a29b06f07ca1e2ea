"""``@record``: the immutable named tuples every module defines its records with.

A class body written as for ``typing.NamedTuple`` (annotated fields, defaults last, methods,
properties, a docstring) becomes a ``collections.namedtuple`` subclass: fields by name and position,
``_replace``, ``_asdict``, equality and hashing as tuples, no assignment.

Why not ``typing.NamedTuple`` itself: it checks every annotation when the class is made, and under
``from __future__ import annotations`` each one is a string it compiles into a ``ForwardRef``. The
session path defines 14 records with 93 fields: 2-4 ms of every warm start's imports went to
compiling annotations nothing reads at run time. Type checkers read them as written
(``dataclass_transform``).
"""
from __future__ import annotations

from collections import namedtuple
from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda decorator: decorator

T = TypeVar("T", bound=type)

#: What a class body holds that the named tuple makes itself.
_MADE_BY_THE_TUPLE = frozenset({"__dict__", "__weakref__"})


@dataclass_transform(eq_default=True, frozen_default=True)
def record(cls: T) -> T:
    """The named tuple of ``cls``'s annotated fields (in order; a field with a value has that default),
    with everything else of the class body (docstring, methods, properties, constants)."""
    body = cls.__dict__
    fields = tuple(body.get("__annotations__", {}))
    defaults = [body[name] for name in fields if name in body]
    if any(name not in body for name in fields[len(fields) - len(defaults):]):
        raise TypeError(f"{cls.__qualname__}: a field without a default follows one with a default")
    base = namedtuple(cls.__name__, fields, defaults=defaults, module=cls.__module__)
    namespace = {k: v for k, v in body.items() if k not in fields and k not in _MADE_BY_THE_TUPLE}
    namespace["__slots__"] = ()
    return type(cls.__name__, (base,), namespace)  # type: ignore[return-value]
