"""Constants no graph determines (interpreter, imports, ORT's code pages, thread and arena overhead), fitted by ``bench/estimator/calibrate.py`` into ``calibration.json``.

Part of :mod:`ortmem.plan.estimate` (see ``estimator`` for the method)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


from ...ortmodel.release import capabilities

MiB = 1 << 20
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


# ---------------------------------------------------------------------------------- calibration
@dataclass
class Calibration:
    """Constants no graph determines; see calibration.json for the measurements behind them."""

    baseline_bytes: int = 68 * MiB
    session_fixed_bytes: int = int(7.4 * MiB)
    ortmem_fixed_bytes: int = int(8.5 * MiB)
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
        release (``ortmodel.release``), when it did: the one constant every estimate adds whole."""
        measured = capabilities().import_baseline_bytes
        return dataclasses.replace(self, baseline_bytes=measured) if measured else self

    def release_note(self) -> str | None:
        """A warning when the installed ORT is another (major, minor) than the one the constants were fitted on."""
        from ...ortmodel.release import installed, parse_version

        here = installed().version
        if not self.onnxruntime or parse_version(here)[:2] == parse_version(self.onnxruntime)[:2]:
            return None
        return (f"calibrated on onnxruntime {self.onnxruntime}; installed {here}: the allocator constants were not "
                "refitted for it (release-specific behaviour such as pre-packed validation is modelled)")


