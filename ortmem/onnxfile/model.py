"""``Model``: what ``ortmem.load`` returns — a skeleton ModelProto and the store of its weights."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ortmem.onnxfile.weights import WeightRef, WeightStore

if TYPE_CHECKING:  # a Model comes from the loader, which imports onnx; naming the class needs none
    import onnx


@dataclass(eq=False)
class Model:
    """A loaded model whose skeleton holds no weight bytes.

    Every large tensor in ``skeleton`` is external data: either the original external file, or a
    span of the .onnx file itself where the bytes were embedded (``embedded_spans`` counts those).
    ``passes`` lists rewrites applied since loading; a model with neither can be handed to ORT by
    its original path.
    """

    path: Path
    skeleton: onnx.ModelProto
    store: WeightStore
    embedded_spans: int = 0
    passes: list[str] = field(default_factory=list)

    @property
    def weights(self) -> list[WeightRef]:
        return list(self.store)

    def weight(self, name: str, graph: str = "") -> WeightRef:
        return self.store.get(name, graph)

    def __iter__(self) -> Iterator[WeightRef]:
        return iter(self.store)

    @property
    def folder(self) -> Path:
        return self.path.parent.resolve()

    @property
    def pristine(self) -> bool:
        """True when the file on disk is already what ORT should load (nothing embedded, nothing rewritten)."""
        return self.embedded_spans == 0 and not self.passes

    @property
    def weight_bytes(self) -> int:
        return sum(r.nbytes for r in self.store)

    def release(self) -> int:
        """Give back every mapped page; the skeleton stays usable, the weights do not."""
        return self.store.release_all()

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
