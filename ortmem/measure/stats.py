"""The bench's order of execution and its summary statistics: pure functions, tested on made-up samples.

Order (:func:`schedule`): repeats run in rounds, every strategy once per round, and round ``r`` runs the
strategies rotated by ``r`` (A B C, B C A, C A B, ...). Why rounds: the machine drifts (page cache,
other tenants), and rounds spread the drift over every strategy. Why rotate: with a fixed order each
strategy always follows the same one, so one strategy always starts after another's writes or its
background work, and any effect with period two in consecutive fresh processes (ORT's init on a large
QDQ model can alternate between two modes from one process to the next) lands on the same strategies
every round. Rotating moves every strategy through every position.

Summary (:class:`Stat`): median, fastest (``min``) and slowest, per metric. The fastest is the least
disturbed sample of a time (noise only ever adds), the median what a user typically gets; the bench
reports both because a median of three lands on either mode of a bimodal distribution.

Bimodal (:func:`split_modes`): sort the samples and find the largest gap between neighbours; the
distribution is flagged bimodal when that gap exceeds ``BIMODAL_GAP[metric]`` of the median and
``BIMODAL_MIN_GAP[metric]`` in absolute terms. 3 % (and 2 MiB) for memory: glibc's heap layout moves a
peak by whole weight tensors, a few percent each. 20 % (and 50 ms) for times: plain scheduling noise
on a busy small machine stays well under that between neighbouring samples of a second-long init,
ORT's two init modes are much further apart, and a 10 ms init on a tiny model jitters by more than
20 % without any second mode. It is a flag for
the reader, not a test: with two samples any large gap is flagged.

Ratios of times (:class:`RatioStat`): the fastest over the reference's fastest, and the median of the
rounds' own ratios (each round's sample over the reference's sample of the same round: an alternating
pair). Why pairs and not median over median: the machine drifts within a run (ORT's init can fall
by a third over a few rounds), and two processes of one round meet the same machine; the median over
the reference's median moves with whichever of ORT's modes comes up more often. Two methods that time
the same strategies (the bench's probes and whole processes) therefore agree on the paired median
where they need not on the median of medians.

Noise (:func:`agreement`): a run of N rounds is a sample, so two methods can disagree by chance. The
rounds are resampled with replacement (a bootstrap, seeded: the same report always gives the same
band), both methods' ratios recomputed on each resample, and the 2.5th-97.5th percentile of their
disagreement is the band a chance disagreement stays in. A disagreement outside the target whose band
reaches 0 is noise; one whose band does not is a real difference between what the two methods measure.
Two limits, stated where the verdicts are printed: a resample's fastest is never below the sample's,
so the band of a fastest ratio is narrower than its true spread (a NO on a fastest ratio alone is weak
evidence); and over many ratios about one in twenty falls outside its 95 % band by chance.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, TypeVar

T = TypeVar("T")

#: Largest gap between neighbouring sorted samples, as a fraction of the median, that is still one mode.
BIMODAL_GAP = {"peak_bytes": 0.03, "create_wall_s": 0.20, "wall_s": 0.20}
#: ... and the smallest absolute gap that counts (bytes, seconds).
BIMODAL_MIN_GAP = {"peak_bytes": 2 * 1024 * 1024, "create_wall_s": 0.05, "wall_s": 0.05}


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` rotated left by ``r``: round ``r``'s order."""
    if not items:
        return []
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def schedule(models: Sequence[str], strategies: Sequence[str], repeat: int,
             first: int = 0) -> list[tuple[str, str, int]]:
    """Execution order: per model, ``repeat`` rounds numbered from ``first``, round ``r`` every strategy
    once, rotated by ``r`` (a bench run round by round keeps the rotation of one run of them all)."""
    return [(m, s, r) for m in models for r in range(first, first + repeat) for s in rotated(strategies, r)]


@dataclass
class Stat:
    """Median, fastest (``min``), slowest (``max``) and count of one metric's samples."""

    median: float
    min: float
    max: float
    n: int

    @property
    def fastest(self) -> float:
        """The smallest sample: for a time, the least disturbed one."""
        return self.min

    @classmethod
    def of(cls, values: Iterable[float | None]) -> "Stat | None":
        vals = [float(v) for v in values if v is not None]
        if not vals:
            return None
        return cls(statistics.median(vals), min(vals), max(vals), len(vals))


def split_modes(values: Iterable[float | None], gap_fraction: float,
                min_gap: float = 0.0) -> tuple[list[float], list[float]] | None:
    """The samples split at their largest gap (low mode, high mode) when that gap exceeds
    ``gap_fraction`` of the median and ``min_gap``; ``None`` for one mode (or fewer than two samples)."""
    vals = sorted(float(v) for v in values if v is not None)
    if len(vals) < 2:
        return None
    median = statistics.median(vals)
    gap, i = max((vals[j + 1] - vals[j], j) for j in range(len(vals) - 1))
    if median <= 0 or gap <= gap_fraction * median or gap <= min_gap:
        return None
    return vals[: i + 1], vals[i + 1 :]


def metric_modes(values: Iterable[float | None], metric: str) -> tuple[list[float], list[float]] | None:
    """:func:`split_modes` with ``metric``'s thresholds (``BIMODAL_GAP``, ``BIMODAL_MIN_GAP``)."""
    return split_modes(values, BIMODAL_GAP[metric], BIMODAL_MIN_GAP[metric])


def modes_text(modes: tuple[list[float], list[float]], scale: float = 1.0, unit: str = "", fmt: str = ".2f") -> str:
    """``"1.65|2.90 s (2+1)"``: each mode's median and how many samples fell in it."""
    low, high = modes
    a, b = statistics.median(low) / scale, statistics.median(high) / scale
    return f"{a:{fmt}}|{b:{fmt}}{unit} ({len(low)}+{len(high)})"


@dataclass
class RatioStat:
    """A time over the reference's: ``fastest`` over its fastest, ``median`` of the rounds' own ratios
    (module docstring: why pairs), and how many rounds paired."""

    fastest: float
    median: float
    pairs: int

    @classmethod
    def of(cls, mine: Mapping[int, float], ref: Mapping[int, float]) -> "RatioStat | None":
        """From samples keyed by round; ``None`` when no round has both (or the reference is 0)."""
        rounds = [r for r in mine if r in ref and ref[r] > 0]
        if not rounds or min(ref.values()) <= 0:
            return None
        paired = [mine[r] / ref[r] for r in rounds]
        return cls(min(mine.values()) / min(ref.values()), statistics.median(paired), len(rounds))


#: How far two methods' ratios may differ and still agree (within 10 %).
AGREE_WITHIN = 0.10
#: Resamples of the rounds for the noise band, and the band's percentiles: 95 %, so that of the 18
#: ratios a six-strategy cross-check compares about one, not two, is called NO by chance alone.
BOOTSTRAP_RESAMPLES = 400
BAND = (0.025, 0.975)


@dataclass
class Agreement:
    """``theirs / mine - 1`` for one statistic of a ratio, the band chance alone would give it, and the
    verdict: ``"yes"`` within :data:`AGREE_WITHIN`, ``"noise"`` outside it with a band reaching 0,
    ``"NO"`` otherwise."""

    value: float
    low: float
    high: float

    @property
    def verdict(self) -> str:
        if abs(self.value) <= AGREE_WITHIN:
            return "yes"
        return "noise" if self.low <= 0.0 <= self.high else "NO"

    def text(self) -> str:
        return f"{self.value:+.0%} [{self.low:+.0%},{self.high:+.0%}] {self.verdict}"


def agreement(mine: Mapping[str, Mapping[int, float]], theirs: Mapping[str, Mapping[int, float]],
              strategy: str, reference: str, seed: int = 0) -> dict[str, Agreement]:
    """How two methods' ratios of ``strategy`` to ``reference`` agree, per statistic (``fastest``,
    ``median``): each method gives samples keyed by round; rounds are resampled jointly for both
    methods (one round's probes and whole processes met the same machine)."""
    def ratios(rounds: Sequence[int]) -> dict[str, float] | None:
        out = []
        for samples in (mine, theirs):
            # a round drawn twice counts twice: keys (draw index) stand for the resampled rounds
            a = {i: samples[strategy][r] for i, r in enumerate(rounds) if r in samples[strategy]}
            b = {i: samples[reference][r] for i, r in enumerate(rounds) if r in samples[reference]}
            ratio = RatioStat.of(a, b)
            if ratio is None:
                return None
            out.append(ratio)
        return {k: getattr(out[1], k) / getattr(out[0], k) - 1 for k in ("fastest", "median")}

    rounds = sorted(set().union(*(s.keys() for m in (mine, theirs) for s in (m[strategy], m[reference]))))
    whole = ratios(rounds) if rounds else None
    if whole is None:
        return {}
    rng = random.Random(seed)
    draws = [d for d in (ratios([rng.choice(rounds) for _ in rounds]) for _ in range(BOOTSTRAP_RESAMPLES)) if d]
    out = {}
    for key, value in whole.items():
        values = sorted(d[key] for d in draws) or [value]
        low, high = (values[min(len(values) - 1, int(q * len(values)))] for q in BAND)
        out[key] = Agreement(value, low, high)
    return out
