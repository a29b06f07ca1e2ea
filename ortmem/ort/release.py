"""The installed ONNX Runtime: its release, build and CPU, and what it does with the patterns ortmem rewrites.

Why one place
-------------
ortmem promises outputs equal to ORT's own run of the QDQ model. What ORT fuses and which fused
kernels it runs correctly differ between releases (block size 512 fuses on 1.32 and not on 1.31; 1.25
refuses a 2-bit GatherBlockQuantized with zero points; 1.32 re-packs and checks every saved pre-packed
weight on reload; 1.28 fuses a 512 block into a kernel that refuses it). Every decision that depends on
the release is taken here, and it is taken by **the probe**: :mod:`ortmem.measure.release_probe` run once per
ORT build and CPU (a subprocess of a few seconds; the answers are cached beside the conversion cache in
a private folder) measures, bit for bit against that ORT's own run of each pattern, what the installed
build fuses, runs identically, saves and reloads (:func:`from_probe`). So a release between two tested
ones, or newer than every tested one, is converted exactly where its probe proves the rewrite
identical; a question the probe cannot answer leaves the pattern to ORT.

:data:`RELEASE_TABLE` is the record of what each *tested* release's probe measured (cross-read with ORT's
source, ``docs/ort-releases.md``): docs, ``ortmem doctor`` and the tests compare the probe with it, and a
disagreement is a note, not a gate. A release older than :data:`SUPPORTED` gets zero-copy loading
only: no conversion, no pre-packed weights, one warning; one newer than the last tested one gets one
notice that it is untested.
"""
from __future__ import annotations

import functools
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

from ortmem.base.records import record
from ortmem.base import logs
from ortmem.base.hashing import short_hash
from ortmem.base.child_env import cache_folder, helper_environment
from ortmem.files.stamps import boot_id
from ortmem.files.trust import first_private_folder, make_private_dir, stat_untrusted_reason
from ortmem.ort.variants import (ACCURACY_LEVELS, BLOCK_SWEEP, GATHER_WEIGHT_TYPES, SCALE_TYPES, SHARED_WEIGHT_KEY, WEIGHT_TYPES, variant_key)


#: The oldest (major, minor) ortmem converts for, and the newest it was tested with. 1.25 is the
#: oldest because (a) it is the oldest release whose DQ+MatMul rule fuses every weight type ortmem
#: writes (2/4/8-bit, signed and unsigned, zero points, fp16 scales; 1.20-1.24 fuse 4-bit only, probe in
#: docs/ort-releases.md), and (b) pre-packed weights can be saved and reloaded from an external file
#: (used by warm starts). A newer release than the last tested one is converted where its own probe
#: proves the rewrite identical (one notice says it is untested).
SUPPORTED = ((1, 25), (1, 32))
#: Releases the suite runs against in CI (``.ci/run``) and whose probe answers make up the table.
TESTED_RELEASES = ("1.25.1", "1.28.0", "1.31.1", "1.32.0")
#: Bumped whenever the probe asks new questions (old cached answers are then asked again). 5: the
#: import baseline includes the conversion's imports (a warm start no longer imports onnx). 6: pre-packed
#: weights are asked of ORT's finished model (:func:`ortmem.store.finished.finish_model`).
PROBE_FORMAT = 7
PROBE_TIMEOUT_S = 300

# x86 / arm flags that select MLAS kernels and with them packed layouts and fused kernels.
_CPU_FLAGS = frozenset("""
sse3 ssse3 sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512bw avx512dq avx512vl avx512cd avx512_vnni
avx512vnni avx_vnni avxvnni avx512_bf16 avx512_fp16 avx_vnni_int8 avxvnniint8 amx_tile amx_int8 amx_bf16
amx_fp16 asimd asimddp asimdhp fphp sve sve2 i8mm bf16 svei8mm svebf16 sme sme2
""".split())


@record
class ReleaseFacts:
    """What one tested release does (one row of :data:`RELEASE_TABLE`)."""

    #: Largest DQ block size ORT's ``DQMatMulToMatMulNBits`` fuses (smallest is always 16;
    #: :data:`UNBOUNDED` where the rule has no upper bound).
    fusion_block_max: int
    #: Largest block size for which ORT's fused kernel and ortmem's rewrite agree bit for bit (1.25 fuses
    #: block 512 and up but its kernel is only right up to 256; ortmem leaves those to ORT).
    convert_block_max: int
    #: Probe variant keys (``probe.variant_key``) ORT fuses and ortmem's rewrite reproduces bit for bit:
    #: everything not listed under ``matmul_not`` / ``gather_not``.
    matmul_not: frozenset[str] = frozenset()
    gather_not: frozenset[str] = frozenset()
    #: The DQ+MatMul rule rejects a DQ whose weight or scale has other consumers (PR #28326, after 1.25).
    shared_initializer_guard: bool = True
    #: ``session.save_external_prepacked_constant_initializers`` writes blobs ORT maps on reload.
    prepacked_save: bool = True
    #: ``session.use_external_initializer_file_buffers_directly`` (new in 1.31): ORT borrows in-memory
    #: external data instead of copying it (``ortmem.session.inmemory``; tests/session/test_convert.py checks both ways).
    borrows_memory_buffers: bool = True
    #: ORT packs every saved weight again on reload and refuses a blob that differs
    #: (``session_state.cc ValidatePrePackedWeights``, new in 1.32).
    prepacked_validated: bool = False


def _keys(kind: str, wtypes: tuple[str, ...], zps=(False, True), stypes=tuple(SCALE_TYPES),
          accs=ACCURACY_LEVELS) -> frozenset[str]:
    return frozenset(variant_key(kind, w, z, s, a) for w in wtypes for z in zps for s in stypes for a in accs)


def _gather_keys(wtypes: tuple[str, ...], zps=(False, True), stypes=tuple(SCALE_TYPES)) -> frozenset[str]:
    return _keys("gather", wtypes, zps, stypes, accs=(4,))


#: A rule without an upper block bound.
UNBOUNDED = 1 << 30

#: What each tested release does, as its probe measured it in a fresh venv (``python -m ortmem doctor
#: --probe``) and cross-read with ORT's source (docs/ort-releases.md). The record, not a gate: ortmem
#: does what the installed build's probe shows (:func:`from_probe`); tests/ort/test_release.py checks that
#: each tested release's probe still agrees with its row.
RELEASE_TABLE: dict[tuple[int, int], ReleaseFacts] = {
    # 1.25: ORT's own fused 2-bit MatMulNBits with fp16 scales fails at run (matmul_nbits.cc
    # "nbits_ == 8"); GatherBlockQuantized refuses bits=2 data; the rule fuses any block size but the
    # kernel is wrong past 256; MatMulNBits writes no pre-packed blobs when a model is saved.
    (1, 25): ReleaseFacts(fusion_block_max=UNBOUNDED, convert_block_max=256,
                          matmul_not=_keys("matmul", ("int2", "uint2"), stypes=("float16",)),
                          gather_not=_gather_keys(("uint2",)), shared_initializer_guard=False,
                          prepacked_save=False, borrows_memory_buffers=False),
    # 1.28: the shared-initializer guard is in; the rule stops at 256 (a 512 block fuses into a kernel
    # that refuses it, so ORT fails on such a QDQ model); pre-packed blobs are saved and mapped unread,
    # but ORT's finished model of a small decoder gives other outputs than its source, so ortmem makes no
    # finished models here; every 2-bit variant runs; in-memory external data is still copied.
    (1, 28): ReleaseFacts(fusion_block_max=256, convert_block_max=256, prepacked_save=False,
                          borrows_memory_buffers=False),
    # 1.31: the rule stops at 256 (PR #31678).
    (1, 31): ReleaseFacts(fusion_block_max=256, convert_block_max=256),
    # 1.32: the bound is gone again and the kernel is right up to the probe's largest block (2048);
    # saved pre-packed weights are re-packed and compared on reload.
    (1, 32): ReleaseFacts(fusion_block_max=UNBOUNDED, convert_block_max=2048, prepacked_validated=True),
}


@record
class Release:
    """The ORT this process imports: version, build identity and CPU (what probe answers depend on)."""

    version: str
    build: str
    cpu_flags: tuple[str, ...]
    machine: str

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return parse_version(self.version)

    @property
    def supported(self) -> bool:
        """Not older than the range: newer releases than the last tested one are probed like any other."""
        return SUPPORTED[0] <= self.version_tuple[:2]

    def key(self) -> str:
        blob = json.dumps([PROBE_FORMAT, self.version, self.build, self.cpu_flags, self.machine]).encode()
        return short_hash(blob, 24)

    def facts(self) -> Optional[ReleaseFacts]:
        """This release's row of :data:`RELEASE_TABLE` (its (major, minor)), or None for an untested one."""
        return RELEASE_TABLE.get(self.version_tuple[:2]) if self.supported else None


def parse_version(text: str) -> tuple[int, ...]:
    """``"1.32.0"`` -> ``(1, 32, 0)``; development suffixes (``1.33.0.dev2026``, ``1.32.0+cpu``) are dropped."""
    out: list[int] = []
    for part in text.replace("+", ".").split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out + [0] * (3 - len(out)))


@functools.lru_cache(maxsize=None)
def cpu_flags() -> tuple[str, ...]:
    """The CPU instruction-set flags that select ORT's (MLAS) kernels; empty where /proc is absent."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() in ("flags", "Features"):
                    flags.update(v.split())
    except OSError:
        pass
    return tuple(sorted(flags & _CPU_FLAGS))


def machine() -> str:
    """The CPU architecture (``platform.machine()``, read without importing :mod:`platform`)."""
    return os.uname().machine


@functools.lru_cache(maxsize=None)
def installed() -> Release:
    """The ORT release this process runs. The build is identified by the native module's size and
    modification time, so a rebuilt or reinstalled wheel of the same version is probed again."""
    import onnxruntime as ort
    from onnxruntime.capi import onnxruntime_pybind11_state as native

    try:
        st = os.stat(native.__file__)
        build = f"{Path(native.__file__).name}:{st.st_size}:{st.st_mtime_ns}"
    except (OSError, AttributeError, TypeError):
        build = "unknown"
    return Release(ort.__version__, build, cpu_flags(), machine())


# ------------------------------------------------------------------------------------ capabilities


@record
class Verdict:
    """Whether ortmem may convert one variant on this ORT, and why (or why not)."""

    ok: bool
    why: str = ""


@record
class Capabilities:
    """What ortmem may do on the installed ORT: the table and the probe, reconciled (a named tuple, as
    every record a warm start imports: :class:`ortmem.session.handoff.Handoff` says why)."""

    release: Release
    #: False: convert nothing (release outside :data:`SUPPORTED`, or the probe could not run).
    convert: bool
    fusion_block_max: int
    convert_block_max: int = 256
    matmul: Mapping[str, Verdict] = {}  # read-only by contract, as every field here
    gather: Mapping[str, Verdict] = {}
    prepacked_save: bool = False
    prepacked_validated: bool = False
    shared_initializer_guard: bool = True
    borrows_memory_buffers: bool = True
    #: RSS of a fresh interpreter with numpy, onnxruntime and ortmem's session path imported (probed; 0: unknown)
    import_baseline_bytes: int = 0
    #: ``table``: not probed (the probe child itself, and tests of the table); ``probe``: reconciled.
    source: str = "table"
    notes: tuple[str, ...] = ()

    def matmul_refusal(self, *, weight_type: str, has_zp: bool, scale_type: str, accuracy: int,
                       block_size: int = 32) -> Optional[str]:
        """None when a DQ+MatMul of this kind may be converted; else the reason it is left to ORT."""
        refusal = self._refusal(self.matmul, _variant("matmul", weight_type, has_zp, scale_type, accuracy))
        if refusal is None and block_size > self.convert_block_max:
            return (f"onnxruntime {self.release.version}: block size {block_size} is past {self.convert_block_max}, "
                    "the largest for which its fused kernel and ortmem's rewrite were shown to agree")
        return refusal

    def gather_refusal(self, *, weight_type: str, has_zp: bool, scale_type: str) -> Optional[str]:
        """None when a DQ+Gather of this kind may become GatherBlockQuantized; else why not."""
        return self._refusal(self.gather, _variant("gather", weight_type, has_zp, scale_type, 4))

    def _refusal(self, table: Mapping[str, Verdict], key: str) -> Optional[str]:
        if not self.convert:
            return self.notes[0] if self.notes else f"onnxruntime {self.release.version}: conversion disabled"
        verdict = table.get(key)
        if verdict is None:
            return f"onnxruntime {self.release.version}: variant {key} was not probed"
        return None if verdict.ok else verdict.why

    def as_dict(self) -> dict[str, Any]:
        return {
            "onnxruntime": self.release.version, "build": self.release.build, "machine": self.release.machine,
            "cpu_flags": list(self.release.cpu_flags), "supported_range": [".".join(map(str, v)) for v in SUPPORTED],
            "tested_releases": list(TESTED_RELEASES), "convert": self.convert, "source": self.source,
            "fusion_block_max": self.fusion_block_max, "convert_block_max": self.convert_block_max,
            "prepacked_save": self.prepacked_save,
            "prepacked_validated": self.prepacked_validated,
            "shared_initializer_guard": self.shared_initializer_guard,
            "borrows_memory_buffers": self.borrows_memory_buffers, "import_baseline_bytes": self.import_baseline_bytes,
            "notes": list(self.notes),
            "matmul": {k: {"ok": v.ok, "why": v.why} for k, v in sorted(self.matmul.items())},
            "gather": {k: {"ok": v.ok, "why": v.why} for k, v in sorted(self.gather.items())},
        }


def _variant(kind: str, weight_type: str, has_zp: bool, scale_type: str, accuracy: int) -> str:
    return variant_key(kind, weight_type, has_zp, scale_type, accuracy if kind == "matmul" else 4)


def all_variant_keys() -> tuple[frozenset[str], frozenset[str]]:
    """Every variant the probe asks about: (DQ+MatMul keys, DQ+Gather keys)."""
    return _keys("matmul", tuple(WEIGHT_TYPES)), _gather_keys(GATHER_WEIGHT_TYPES)


def outside_range_capabilities(release: Release) -> Capabilities:
    """A release older than the range: zero-copy loading only, with the one note that says so."""
    lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
    note = (f"onnxruntime {release.version} is older than ortmem's range ({lo} on; tested {lo}-{hi}.x): models are "
            "loaded without copies but not converted, and no pre-packed weights are used")
    return Capabilities(release, False, 256, 0, notes=(note,))


def table_capabilities(release: Optional[Release] = None) -> Optional[Capabilities]:
    """What :data:`RELEASE_TABLE` recorded for ``release`` (None for a release without a row): the
    record that docs, ``ortmem doctor`` and the tests compare the probe with, never a gate."""
    release = release or installed()
    facts = release.facts()
    if facts is None:
        return None
    mm_keys, ga_keys = all_variant_keys()
    why = f"onnxruntime {release.version}: the release table records that ORT does not fuse or run this variant identically"
    matmul = {k: Verdict(k not in facts.matmul_not, "" if k not in facts.matmul_not else why) for k in mm_keys}
    gather = {k: Verdict(k not in facts.gather_not, "" if k not in facts.gather_not else why) for k in ga_keys}
    return Capabilities(release, True, facts.fusion_block_max, facts.convert_block_max, matmul, gather,
                        facts.prepacked_save, facts.prepacked_validated, facts.shared_initializer_guard,
                        facts.borrows_memory_buffers, source="table")


def unrestricted_capabilities(release: Optional[Release] = None) -> Capabilities:
    """Every variant allowed, the widest block bound: what the probe child converts with, so that it
    checks ortmem's rewrite on every variant, whatever any table expects."""
    release = release or installed()
    mm_keys, ga_keys = all_variant_keys()
    return Capabilities(release, True, UNBOUNDED, UNBOUNDED, {k: Verdict(True) for k in mm_keys},
                        {k: Verdict(True) for k in ga_keys}, True, False, True, True, source="unrestricted")


def probe_verdict(answer: Optional[Mapping[str, Any]], kind: str) -> Verdict:
    """Convertible only where the probe saw ORT fuse the pattern (DQ+MatMul; ORT has no DQ+Gather fusion
    to agree with), run its own result, and ortmem's rewrite give bit-identical outputs."""
    if answer is None:
        return Verdict(False, "not probed")
    if answer.get("probe_error"):
        return Verdict(False, f"the probe failed ({answer['probe_error']})")
    if kind == "matmul" and not answer.get("fused"):
        return Verdict(False, "ORT does not fuse it" + (f" ({answer['ort_error']})" if answer.get("ort_error") else ""))
    if answer.get("reference_error"):
        return Verdict(False, f"ORT fails to run its own fused model ({answer['reference_error']})")
    if answer.get("ortmem") != "equal":
        return Verdict(False, f"ortmem's rewrite: {answer.get('ortmem', 'not run')}")
    return Verdict(True)


def from_probe(release: Release, answers: Mapping[str, Any]) -> Capabilities:
    """What ortmem may do on ``release``: decided by the probe's measurements on it alone.

    Every variant, the block-size bounds, the shared-initializer guard, pre-packed saving and
    checking, and in-memory borrowing are what the installed build was seen to do. Where an answer is
    missing the safe side is taken (not converted, guard assumed, nothing saved): leaving a pattern
    to ORT can never change an output. The table (:data:`RELEASE_TABLE`) only adds notes where a
    tested release's row and the probe disagree, and a release newer than the last tested one gets
    one note saying so.
    """
    variants = answers.get("variants", {})
    mm_keys, ga_keys = all_variant_keys()

    def verdicts(keys: frozenset[str], kind: str) -> dict[str, Verdict]:
        out = {}
        for key in sorted(keys):
            v = probe_verdict(variants.get(key), kind)
            out[key] = v if v.ok else Verdict(False, f"onnxruntime {release.version} probe: {v.why}")
        return out

    packed = answers.get("prepacked", {})
    fused_max, equal_max = probed_block_max(variants)
    shared = variants.get(SHARED_WEIGHT_KEY)
    caps = Capabilities(
        release, True, fused_max, equal_max, verdicts(mm_keys, "matmul"), verdicts(ga_keys, "gather"),
        prepacked_save=bool(packed.get("saved") and packed.get("reload") == "equal"),
        prepacked_validated=bool(packed.get("validated", False)),
        # no answer, or ORT left the shared pair alone: the guard holds (the side that converts less)
        shared_initializer_guard=not (isinstance(shared, dict) and shared.get("fused") is True),
        borrows_memory_buffers=bool(answers.get("borrows_memory_buffers", False)),
        import_baseline_bytes=int(answers.get("import_baseline_bytes") or 0), source="probe")
    return caps._replace(notes=tuple(_notes(caps)))


def _notes(caps: Capabilities) -> list[str]:
    """Where the probe and the table's row for this release disagree (the record is then stale: the
    probe's answer is what ortmem does), or that the release is newer than every tested one."""
    release = caps.release
    if release.version_tuple[:2] > max(RELEASE_TABLE):
        return [f"onnxruntime {release.version} is newer than the last release ortmem was tested with "
                f"({TESTED_RELEASES[-1]}): ortmem converts what its probe proves identical on it"]
    facts = release.facts()  # the row itself, not table_capabilities(): every start reads these notes
    if facts is None:
        return []
    notes = [f"probe and table disagree on {k}" for k, v in caps.matmul.items() if v.ok == (k in facts.matmul_not)]
    notes += [f"probe and table disagree on {k}" for k, v in caps.gather.items() if v.ok == (k in facts.gather_not)]
    for name in ("fusion_block_max", "convert_block_max", "prepacked_save", "prepacked_validated",
                 "shared_initializer_guard", "borrows_memory_buffers"):
        probed, recorded = getattr(caps, name), getattr(facts, name)
        if probed != recorded:
            notes.append(f"probe and table disagree on {name}: the probe says {probed}, the table {recorded}")
    return notes


def probed_block_max(variants: Mapping[str, Any]) -> tuple[int, int]:
    """(largest swept block size up to which ORT fuses every power of two, largest up to which ortmem's
    rewrite is also identical). Where ORT fuses the whole sweep its rule has no bound the sweep can
    see: :data:`UNBOUNDED` (ortmem still converts only up to the second number, which the sweep proved)."""
    fused = equal = 0
    still_equal = True
    for block in BLOCK_SWEEP:
        a = variants.get(f"block:{block}", {})
        if not a.get("fused"):
            break
        fused = block
        still_equal = still_equal and a.get("ortmem") == "equal" and not a.get("reference_error")
        if still_equal:
            equal = block
    return (UNBOUNDED if fused == BLOCK_SWEEP[-1] else fused), equal


def well_formed(answers: Any) -> bool:
    """Probe answers :func:`reconcile` can read: anything else (a damaged file, a child that printed
    something else) is treated as no answer."""
    return (isinstance(answers, dict) and isinstance(answers.get("variants"), dict)
            and all(isinstance(v, dict) for v in answers["variants"].values())
            and isinstance(answers.get("prepacked", {}), dict))


def run_probe(timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Run :mod:`ortmem.measure.release_probe` in a fresh interpreter (an ORT crash costs the probe only).

    The child is a helper (:func:`ortmem.base.child_env.helper_environment`): never hooked, since it must
    compare ORT's own run of each pattern with ortmem's rewrite, and with a cache folder of its own that
    goes with it, so nothing it does can leave entries in the user's cache."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ortmem-probe-run-") as own:
        env = helper_environment(cache_dir=os.path.join(own, "cache"), ORTMEM_PROBE_CHILD="1", OMP_NUM_THREADS="1",
                                 TMPDIR=own)
        proc = subprocess.run([sys.executable, "-c", "from ortmem.measure.release_probe import main; main()"],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=own)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise RuntimeError(f"probe exited with {proc.returncode}: {tail[0][:300]}")
    answers = json.loads(proc.stdout)
    if not well_formed(answers):
        raise ValueError("probe printed no answers ortmem can read")
    return answers


#: The environment variable naming the folder probe answers are kept in (instead of the cache's).
PROBE_DIR_ENV = "ORTMEM_PROBE_DIR"
#: The probe folder's name in the cache folder.
CACHE_PROBE_FOLDER = ".release-probes"
#: The private per-user folder for probe answers where the probe folder cannot be written (a cache
#: deployed read-only): ``$XDG_RUNTIME_DIR/<this>``, else ``<system temp dir>/<this>-<uid>``.
RUNTIME_PROBE_FOLDER = "ortmem-probes"


def probe_dir() -> Optional[Path]:
    """A private folder for probe answers: ``$ORTMEM_PROBE_DIR``, else ``.release-probes`` in the cache
    root (the answers depend on the ORT build and CPU only, so fresh-process children and tests with
    private conversion caches share them); None when it cannot be created or trusted. It may be
    read-only (``ortmem prepare`` wrote it, then the cache was mounted read-only): answers are read
    from it, and kept in :func:`runtime_probe_dir` when it cannot take new ones."""
    try:
        if os.environ.get(PROBE_DIR_ENV):
            d = Path(os.environ[PROBE_DIR_ENV])
        else:
            root = cache_folder()
            make_private_dir(root, parents=True)
            d = root / CACHE_PROBE_FOLDER
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.lstat()
        if not _private(st):
            logs.warning(__name__, "ortmem: %s is not a private folder of this user; probe answers are not cached there", d)
            return None
        return d
    except OSError:
        return None


def runtime_probe_dir(*, create: bool = True) -> Optional[Path]:
    """Where probe answers go when :func:`probe_dir` cannot take them: a private folder of this user,
    ``$XDG_RUNTIME_DIR/ortmem-probes``, else ``ortmem-probes-<uid>`` in the system temp folder, created
    0700 and used only while it passes the cache's trust check (this user's, no link, nobody else may
    write it or rename it away: :mod:`ortmem.files.trust`). Answers in it are named with the boot id
    (:func:`runtime_answers_path`), so they hold until the machine restarts at most. None: no such
    folder (the answers then last as long as the process). ``create`` False: only an existing folder
    (reading answers makes no folder)."""
    candidates = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        candidates.append(Path(runtime) / RUNTIME_PROBE_FOLDER)
    import tempfile

    uid = os.geteuid() if hasattr(os, "geteuid") else 0
    candidates.append(Path(tempfile.gettempdir()) / f"{RUNTIME_PROBE_FOLDER}-{uid}")
    return first_private_folder(candidates, create=create)


def runtime_answers_path(folder: Path, release: Release) -> Path:
    """The answers of ``release`` in the runtime folder: named by the release key and this boot's id,
    so a probe runs at most once per release and boot however many processes start."""
    return folder / f"{short_hash(json.dumps([release.key(), boot_id()]).encode(), 24)}.json"


def _private(st: os.stat_result) -> bool:
    """The cache's own trust check (:func:`ortmem.files.trust.stat_untrusted_reason`): owner, mode, no link."""
    return stat_untrusted_reason(st) is None


def _read_private_json(path: Path) -> Any:
    """The JSON in ``path`` if it is a private file of this user (:func:`_private`, no link), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not _private(os.fstat(fd)):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _read_answers(path: Path) -> Optional[dict[str, Any]]:
    data = _read_private_json(path)
    return data if well_formed(data) else None


def _write_answers(path: Path, answers: dict[str, Any]) -> Optional[str]:
    """Keep ``answers`` at ``path`` (a private temporary file renamed over it); None when kept, else why
    not (a read-only folder, a full disk: ``strerror``)."""
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".probe-", suffix=".json")
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(answers, f)
        os.replace(tmp, path)
        return None
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return exc.strerror or str(exc)


def _keep_answers(release: Release, path: Optional[Path], answers: dict[str, Any]) -> None:
    """Keep a probe's answers where later processes find them: ``path`` (the probe folder's file), else
    the runtime folder until the machine restarts, else nowhere but this process. One notice says where
    when the probe folder could not take them (a cache deployed read-only after an onnxruntime upgrade):
    a process that finds them in the runtime folder later says nothing and probes nothing."""
    why = "none could be made or trusted" if path is None else _write_answers(path, answers)
    if why is None:
        return
    where = f"{path.parent if path is not None else 'a private probe folder'} ({why})"
    runtime = runtime_probe_dir()
    kept = None if runtime is None else _write_answers(runtime_answers_path(runtime, release), answers)
    if runtime is not None and kept is None:
        until = f"in {runtime} until the machine restarts"
    else:
        until = "in this process only (every process probes again)"
    _warn_once(f"onnxruntime {release.version} was probed now and its answers could not be kept in {where}; "
               f"they are kept {until}. Run `ortmem prepare MODEL` (or `ortmem doctor --probe`) with this "
               "onnxruntime where the cache can be written to keep them with the cache")


_current: Optional[Capabilities] = None


def capabilities(*, refresh: bool = False) -> Capabilities:
    """The installed ORT's capabilities, probed once per build and CPU (cached on disk) and per process.

    Answers are read from :func:`probe_dir`, else from :func:`runtime_probe_dir` (a cache that cannot
    be written keeps a new release's answers there until the machine restarts); no folder ortmem
    cannot write ever fails a start (:func:`_keep_answers`)."""
    global _current
    if _current is not None and not refresh:
        return _current
    release = installed()
    if not release.supported:
        _current = outside_range_capabilities(release)
        _warn_once(_current.notes[0])
        return _current
    if os.environ.get("ORTMEM_PROBE_CHILD") == "1":
        return unrestricted_capabilities(release)  # the probe child checks every rewrite: it is what is measured
    folder = probe_dir()
    path = folder / f"{release.key()}.json" if folder else None
    answers = None if (refresh or path is None) else _read_answers(path)
    if answers is None and not refresh:
        runtime = runtime_probe_dir(create=False)
        answers = None if runtime is None else _read_answers(runtime_answers_path(runtime, release))
    probed_now = answers is None
    if answers is None:
        import subprocess

        logs.info(__name__, "ortmem: probing onnxruntime %s (once per build and CPU)", release.version)
        try:
            answers = run_probe()
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
            note = f"onnxruntime {release.version} could not be probed ({exc}): models are not converted"
            _warn_once(note)
            _current = Capabilities(release, False, 256, 0, notes=(note,))
            return _current
        _keep_answers(release, path, answers)
    _current = from_probe(release, answers)
    if probed_now and release.version_tuple[:2] > max(RELEASE_TABLE):
        # once per build and CPU, when its probe runs (later processes read the cached answers quietly,
        # and ortmem doctor keeps showing the note): a hooked program must not print it on every start
        _warn_once(_current.notes[0])
    return _current


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn("ortmem: " + message, RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------------------------ config keys
#: Prefixes of the session config keys an ORT library defines (its ``onnxruntime_session_options_config_keys.h``
#: and the EPs' own): ``session.*``, ``optimization.*``, ``mlas.*`` and ``ep.*``.
CONFIG_KEY_PREFIXES = (b"session.", b"optimization.", b"mlas.", b"ep.")
#: A whole config key from one of the prefixes (compiled by the scan, which runs once per build).
CONFIG_KEY_PATTERN = rb"(?:session|optimization|mlas|ep)\.[a-z0-9_.]*[a-z0-9_]"
#: Bumped whenever :func:`config_keys` reads the library differently.
CONFIG_KEYS_FORMAT = 1
#: The name of a build's config keys in a probe folder: its release key, then this.
CONFIG_KEYS_SUFFIX = "-config-keys.json"


def library_files() -> list[Path]:
    """The native files of the installed ORT that hold its code: the Python module and any
    ``libonnxruntime.so*`` beside it."""
    from onnxruntime.capi import onnxruntime_pybind11_state as native

    module = Path(native.__file__)
    return [module, *sorted(p for p in module.parent.glob("libonnxruntime.so*") if p.is_file())]


def scan_config_keys(files: list[Path]) -> tuple[str, ...]:
    """Every string in ``files`` that is a whole C string shaped like a session config key (one of
    :data:`CONFIG_KEY_PREFIXES`, lower-case words joined by dots): what this build reads from
    ``SessionOptions``' config entries, taken from the library itself instead of a list kept here."""
    shape = re.compile(CONFIG_KEY_PATTERN)
    keys: set[str] = set()
    for path in files:
        data = path.read_bytes()
        for prefix in CONFIG_KEY_PREFIXES:
            at = data.find(prefix)
            while at >= 0:
                if at == 0 or data[at - 1] == 0:
                    m = shape.match(data, at)
                    if m is not None and data[m.end():m.end() + 1] == b"\x00":
                        keys.add(m.group().decode())
                at = data.find(prefix, at + 1)
    return tuple(sorted(keys))


_config_keys: Optional[tuple[str, ...]] = None


def config_keys() -> Optional[tuple[str, ...]]:
    """The session config keys the installed ORT build defines (:func:`scan_config_keys`), read once per
    build and kept with the probe's answers (the probe folder, else the runtime folder, else this
    process); None when the library cannot be read or holds none (a caller's entry ortmem cannot read
    then means no finished entry, never a wrong one)."""
    global _config_keys
    if _config_keys is not None:
        return _config_keys or None
    release = installed()
    name = f"{release.key()}{CONFIG_KEYS_SUFFIX}"
    primary = probe_dir()
    keys = None if primary is None else _read_keys(primary / name, release)
    runtime = None
    if keys is None and (primary is None or not os.access(primary, os.W_OK)):
        runtime = runtime_probe_dir()  # a read-only cache: where an earlier process kept them
        keys = None if runtime is None else _read_keys(runtime / name, release)
    if keys is not None:
        _config_keys = keys
        return keys or None
    try:
        keys = scan_config_keys(library_files())
    except (OSError, ImportError, AttributeError, TypeError) as exc:
        logs.info(__name__, "ortmem: the session config keys of onnxruntime %s cannot be read (%s)", release.version, exc)
        keys = ()
    _config_keys = keys
    record = {"format": CONFIG_KEYS_FORMAT, "release": release.key(), "keys": list(keys)}
    for folder in (primary, runtime):
        if folder is not None and _write_answers(folder / name, record) is None:
            break
    return keys or None


def _read_keys(path: Path, release: Release) -> Optional[tuple[str, ...]]:
    """The keys kept at ``path`` for ``release`` (a private file of this user), or None."""
    record = _read_private_json(path)
    if (not isinstance(record, dict) or record.get("format") != CONFIG_KEYS_FORMAT
            or record.get("release") != release.key() or not isinstance(record.get("keys"), list)):
        return None
    return tuple(str(k) for k in record["keys"])
