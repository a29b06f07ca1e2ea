"""``@record``: a class body as for ``typing.NamedTuple`` becomes an immutable named tuple, its
annotations left as written."""
from __future__ import annotations

import builtins
import pickle
from typing import Optional

import pytest

from ortmem.base.records import record
from ortmem.store.start import Decision, Start


@record
class Sample:
    """A record with a required field, defaults, a method and a property."""

    name: str
    size: int = 0
    note: Optional[str] = None

    def doubled(self) -> int:
        return 2 * self.size

    @property
    def label(self) -> str:
        return f"{self.name}:{self.size}"


def test_fields_defaults_methods_and_docstring_are_those_of_the_class_body():
    s = Sample("a", 3)
    assert Sample._fields == ("name", "size", "note")
    assert (s.name, s.size, s.note) == ("a", 3, None) == tuple(s)
    assert s.doubled() == 6 and s.label == "a:3"
    assert Sample.__doc__.startswith("A record with") and Sample.__module__ == __name__
    assert Sample("a", size=3) == s and hash(Sample("a", size=3)) == hash(s)
    assert repr(s) == "Sample(name='a', size=3, note=None)"


def test_a_record_refuses_assignment_and_replace_keeps_its_class():
    s = Sample("a")
    with pytest.raises(AttributeError):
        s.size = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        s.other = 1  # type: ignore[attr-defined]
    t = s._replace(size=5)
    assert type(t) is Sample and t.label == "a:5" and s.size == 0


def test_a_field_without_a_default_after_one_with_a_default_is_refused():
    with pytest.raises(TypeError, match="Broken"):
        @record
        class Broken:
            first: int = 0
            second: int


def test_making_a_record_compiles_none_of_its_annotations(monkeypatch):
    # typing.NamedTuple compiles every string annotation into a ForwardRef when the class is made
    # (about 45 us each): 93 fields on the session path
    compiled: list[str] = []
    real = builtins.compile
    monkeypatch.setattr(builtins, "compile", lambda source, *a, **k: compiled.append(source) or real(source, *a, **k))

    @record
    class Loose:
        value: Optional[dict[str, "Sample"]] = None

    assert compiled == [] and Loose().value is None
    assert Loose.__annotations__["value"] == "Optional[dict[str, 'Sample']]"


def test_records_round_trip_through_pickle():
    start = Start(Decision.FINISHED, path="/x/model.onnx", fallback="/x/source.onnx")
    assert pickle.loads(pickle.dumps(start)) == start
    assert pickle.loads(pickle.dumps(Sample("a", 2))) == Sample("a", 2)
