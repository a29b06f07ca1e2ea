"""The session path stays clear: few moves between modules, measured on real sessions.

``bench.session_path`` traces real ``ortmem.InferenceSession`` starts (cold, second, warm,
``cache=False``) of a small QDQ model in fresh interpreters and counts the distinct moves between
modules. A path without the store and handoff packages' boundaries climbs back up 46 times over every
branch; the path is held to at most half that, and no module is entered more than three times on any
start. A change that makes the path bounce again (a helper calling back into its caller, a new hub)
fails here with the counts that say where.
"""
from __future__ import annotations

import pytest

from bench.session_path import measure

#: Climbs back up over every branch of a path without the store and handoff packages' boundaries.
REVIEWED_CLIMBS = 46


@pytest.fixture(scope="module")
def counts() -> dict[str, dict]:
    return measure()


def test_each_start_takes_its_own_branch(counts):
    """The counts below are of four different branches (a release that saves no pre-packed weights
    answers the later starts with the entry itself)."""
    assert counts["cold"]["action"] == "converted"
    assert counts["second"]["action"] in ("finished", "cache-hit")
    assert counts["warm"]["action"] in ("finished", "cache-hit")
    assert counts["cache=False"]["action"] in ("in-memory", "converted-temporary")


@pytest.mark.parametrize("start", ["cold", "second", "warm", "cache=False"])
def test_no_module_is_entered_more_than_three_times_on_a_start(counts, start):
    r = counts[start]
    assert r["max_entries"] <= 3, (start, r["entries"])


def test_climbs_over_every_branch_are_at_most_half_the_reviewed_ones(counts):
    r = counts["every branch"]
    assert r["climbs"] <= REVIEWED_CLIMBS // 2, r
