"""Progress output: one line per stage when stderr is not a terminal (CI, ``| tee``, server logs)."""
from __future__ import annotations

import io
import subprocess
import sys

from ortmem.base.progress import progress_bar
from ortmem.measure.synth import SynthConfig, cached_model


def test_not_a_terminal_gets_one_line_per_stage() -> None:
    out = io.StringIO()
    with progress_bar("converting", out) as update:
        for i in range(1, 201):
            update(i * 1_000_000, 200_000_000, f"t{i}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "converting: started (200 MB)"
    assert lines[1].startswith("converting: done, 200 MB in ") and len(lines) == 2
    assert "\r" not in out.getvalue()


def test_generating_a_model_piped_to_a_file(tmp_path) -> None:
    """What ``ortmem bench --demo | tee`` printed: the generation bar repainted per tensor."""
    code = (
        "import sys; from ortmem.base.progress import progress_bar; from ortmem.measure.synth import SynthConfig, cached_model\n"
        "with progress_bar('generating') as bar:\n"
        f"    cached_model(SynthConfig.tiny(storage='external'), {str(tmp_path)!r}, progress=bar)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "\r" not in res.stderr
    assert [line.split(":")[0] for line in res.stderr.splitlines()] == ["generating", "generating"]
    assert cached_model(SynthConfig.tiny(storage="external"), tmp_path).is_file()  # made, not redone
