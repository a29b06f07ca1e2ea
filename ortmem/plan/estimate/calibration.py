"""Constants no graph determines (interpreter, imports, ORT's code pages, thread and arena overhead), fitted by ``bench/estimator/calibrate.py`` into ``calibration.json``.

Part of :mod:`ortmem.plan.estimate` (see ``estimator`` for the method)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


from ortmem.ort.release import capabilities
from ortmem.base.units import MiB

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


# ---------------------------------------------------------------------------------- calibration
@dataclass
class Calibration:
    """Constants no graph determines; see calibration.json for the measurements behind them."""

    #: a process that imported numpy and onnxruntime (and ``import ortmem``, which loads its exception
    #: types only): where plain ORT starts, and ortmem too before its first session
    baseline_bytes: int = 47 * MiB
    session_fixed_bytes: int = int(7.4 * MiB)
    #: what a first ``ortmem.InferenceSession`` imports beyond ``import ortmem`` (its session path: the
    #: handoff and the store's lookup, no onnx): resident from then on, in every process that creates a
    #: session through ortmem; all a warm start imports
    ortmem_import_bytes: int = int(7.1 * MiB)
    #: what a start that converts imports beyond that (onnx, the loader, the passes, the publisher):
    #: resident from then on, in the cold start's side only
    ortmem_convert_import_bytes: int = int(11.0 * MiB)
    #: what the hook holds beyond its imports and ORT's own figure on a cache hit (skeleton, lookup)
    ortmem_fixed_bytes: int = 0
    #: a cold start's creation floor above the baseline and imports: the source digest's read buffer,
    #: the weightless copy's type resolution and the entry's writers, before ORT's session exists
    ortmem_cold_peak_bytes: int = int(16.5 * MiB)
    #: what a cold start still holds after its session was created, beyond a cache hit
    ortmem_cold_retained_bytes: int = 1 * MiB
    run_fixed_bytes: int = int(2.4 * MiB)
    #: share of (DQ-fusion sources + dropped embedded originals) glibc keeps beyond what the heap model
    #: explains, without hygiene (fitted on the calibration models; see docs/estimator.md)
    retention_fraction: float = 0.0
    source: str = "defaults"
    #: the release the constants were fitted on (``ortmem estimate`` warns on another one)
    onnxruntime: str = ""

    @classmethod
    def load(cls, path: Path = CALIBRATION_FILE) -> "Calibration":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        c = data.get("constants", {})
        return cls(**{k: (float(v) if k == "retention_fraction" else int(v)) for k, v in c.items()
                      if k in cls.__dataclass_fields__ and k not in ("source", "onnxruntime")}, source=str(path),
                   onnxruntime=str(data.get("onnxruntime", "")))

    def for_installed_release(self) -> "Calibration":
        """These constants with the import baseline the release probe measured on this machine and
        release (``ortmodel.release``), when it did: the one constant every estimate adds whole.

        The probe measures a process with ortmem's session path and its conversion imported (onnx
        included, :data:`ortmem.measure.release_probe.CONVERSION_MODULES`); plain ORT's side starts
        ``ortmem_import_bytes + ortmem_convert_import_bytes`` lower (measured by
        ``bench/estimator/fixed_costs.py``: what ortmem's imports add does not depend on the ORT
        release, what ``import onnxruntime`` costs does)."""
        measured = capabilities().import_baseline_bytes
        imports = self.ortmem_import_bytes + self.ortmem_convert_import_bytes
        if not measured or measured <= imports:
            return self
        return dataclasses.replace(self, baseline_bytes=measured - imports)

    def release_note(self) -> str | None:
        """A warning when the installed ORT is another (major, minor) than the one the constants were fitted on."""
        from ortmem.ort.release import installed, parse_version

        here = installed().version
        if not self.onnxruntime or parse_version(here)[:2] == parse_version(self.onnxruntime)[:2]:
            return None
        return (f"calibrated on onnxruntime {self.onnxruntime}; installed {here}: the allocator constants were not "
                "refitted for it (release-specific behaviour such as pre-packed validation is modelled)")


