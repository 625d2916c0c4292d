"""The statistics over seeds (``experiments/stats.py``) and the canary comparison (``runner.rerun_canary``,
``runner._agrees``) at their edges, by hand: the gaps the ``experiments`` mutation chunk found (docs/testing.md).

Student-t quantiles from a printed table (two-sided 95 %): ``t_{0.975,5} = 2.571``, ``t_{0.975,6} = 2.447``,
``t_{0.975,16} = 2.120``, ``t_{0.975,17} = 2.110``; for 1 and 2 degrees of freedom in closed form:
``t_{q,1} = tan(pi (q - 1/2))`` (so ``t_{0.975,1} = 12.706``), ``t_{q,2} = (2q - 1) / sqrt(2 q (1 - q))`` (so
``t_{0.9,2} = 0.8 / sqrt 0.18 = 1.885618``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest
from studies import _repo

from lightning_fedhet.experiments import Cell, canary_path, rerun_canary, write_canary
from lightning_fedhet.experiments import records as records_module
from lightning_fedhet.experiments.runner import CANARY_TOLERANCE, _agrees
from lightning_fedhet.experiments.stats import (
    direction,
    fmt_mean_ci,
    mean_ci,
    paired,
    seeds_needed,
    verdict_for_gain,
)
from tests.test_reproduce import TOY, _report


# ----------------------------------------------------------------------------------------------------------- stats
def test_a_cells_interval_at_another_level():
    """[0.50, 0.52, 0.54]: mean 0.52, SD 0.02; at 80 % the half-width is ``1.885618 * 0.02 / sqrt 3 = 0.021773``:
    "52.0 [49.8, 54.2]" (at 95 %, "52.0 [47.0, 57.0]")."""
    assert fmt_mean_ci([0.50, 0.52, 0.54], level=0.8) == "52.0 [49.8, 54.2]"


def test_paired_at_another_level_and_float32_values_in_float64():
    """a - b = [4, 6, 8] (mean 6, SD 2) at 80 %: ``6 +- 1.885618 x 2 / sqrt 3 = 6 +- 2.177324``. float32 rounds
    ``2^24 + 1`` to ``2^24``, so a float32 mean of [2^24, 1, 1] would be 5,592,405.5; in float64 it is exactly
    16,777,218 / 3 = 5,592,406."""
    mean, lo, hi, n = paired({0: 5.0, 1: 7.0, 2: 9.0}, {0: 1.0, 1: 1.0, 2: 1.0}, level=0.8)
    half = 0.8 / math.sqrt(0.18) * 2 / math.sqrt(3)
    assert (mean, n) == (6.0, 3) and (lo, hi) == pytest.approx((6 - half, 6 + half), abs=1e-9)
    assert mean_ci(np.array([2.0**24, 1.0, 1.0], dtype=np.float32))[0] == 5_592_406.0


def test_the_v1_v2_verdict_at_its_edges():
    """``lo > 0`` is strict (an interval starting at 0 reaches 0: direction only); a mean gain of exactly ``ratio x
    paper_gain`` is enough; a mean of exactly 0 is no gain; no paired seed is pending."""
    assert verdict_for_gain(math.nan, math.nan, math.nan) == "pending"
    assert verdict_for_gain(0.0, 0.05, 0.1, paper_gain=0.06) == "direction only"
    assert verdict_for_gain(0.01, 0.03, 0.05, paper_gain=0.06) == "reproduced"  # 0.03 = 0.5 x 0.06
    assert verdict_for_gain(-0.01, 0.0, 0.01) == "not reproduced"


def test_direction_at_its_edges():
    """An interval that starts or ends at exactly 0 holds 0; fewer than two seeds (NaN) gives a dash."""
    assert direction(math.nan, 0.3, math.nan) == "–"
    assert direction(0.5, 0.7, 0.9) == "higher"
    assert direction(0.0, 0.5, 1.0) == "not resolved"
    assert direction(-1.0, -0.5, 0.0) == "not resolved"
    assert direction(-1.0, -0.5, -0.1) == "lower"


def test_seeds_needed_by_the_table():
    """The fewest n with ``t_{0.975,n-1} sd / sqrt n < effect``:

    - sd 2, effect 1: n = 17 gives ``2 x 2.120 / sqrt 17 = 1.028``, n = 18 ``2 x 2.110 / sqrt 18 = 0.995``: 18.
    - sd 1, effect 0.95: n = 6 gives ``2.571 / sqrt 6 = 1.050``, n = 7 ``2.447 / sqrt 7 = 0.925``: 7 (with one
      degree of freedom fewer n = 7 would give ``2.571 / sqrt 7 = 0.972``, not enough).
    - sd 1, effect 9: n = 2 gives ``12.706 / sqrt 2 = 8.985``: 2, the fewest.
    - sd 1, effect 1 needs 7 (``2.447 / sqrt 7 = 0.925``, n = 6: 1.050): found when 7 is the most allowed, None when
      6 is.
    """
    assert seeds_needed(2.0, 1.0) == 18
    assert seeds_needed(1.0, 0.95) == 7
    assert seeds_needed(1.0, 9.0) == 2
    assert seeds_needed(1.0, 1.0, max_seeds=7) == 7
    assert seeds_needed(1.0, 1.0, max_seeds=6) is None


def test_seeds_needed_half_width_equal_to_the_effect_is_not_below_it():
    """The half-width at 7 seeds, used as the effect: 7 seeds do not make it *below* the effect, 8 do."""
    from scipy import stats

    assert seeds_needed(1.0, float(stats.t.ppf(0.975, 6)) / math.sqrt(7)) == 8


def test_seeds_needed_default_reach_and_its_argument():
    """Effect 0.062039 lies between the half-widths at 1,001 seeds (0.0620236) and 1,000 seeds (0.0620547): beyond
    the default ``max_seeds`` of 1,000. The search starts at 2 seeds without numpy's warnings for 0 or 1."""
    from scipy import stats

    effect = 0.062039
    assert stats.t.ppf(0.975, 1000) / math.sqrt(1001) < effect < stats.t.ppf(0.975, 999) / math.sqrt(1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert seeds_needed(1.0, effect) is None
    assert seeds_needed(1.0, effect, max_seeds=1001) == 1001
    with pytest.raises(ValueError, match=r"^effect must be > 0, got 0.0$"):
        seeds_needed(1.0, 0.0)


# ---------------------------------------------------------------------------------------------- canary comparison
def test_floats_agree_within_the_tolerance_relative_to_the_record():
    """``|a - b| <= 1e-3 (1 + |a|)``, ``a`` the recorded value: at a = 0 the bound is 0.001 (0.001 itself agrees,
    0.0015 does not); at a = 1 it is 0.002 (1.0015 agrees); a recorded int meets a float the same way."""
    assert CANARY_TOLERANCE == 1e-3
    assert _agrees(0.0, 0.001, exact=False)
    assert not _agrees(0.0, 0.0015, exact=False)
    assert _agrees(1.0, 1.0015, exact=False)
    assert not _agrees(1.0, 1.0025, exact=False)
    assert _agrees(2.0005, 2, exact=False) and _agrees(2, 2.0005, exact=False)
    assert not _agrees(2.0005, 2, exact=True)


def test_flags_texts_and_structure_are_compared_exactly():
    """A recorded flag is not a number within the tolerance (``True`` is not ``1.0005``); nested lists and dicts
    compare element by element with the tolerance."""
    assert not _agrees(True, 1.0005, exact=False)
    assert not _agrees("abc", "abd", exact=False) and _agrees(None, None, exact=False)
    assert _agrees({"acc": [0.5, 0.25]}, {"acc": [0.5004, 0.2502]}, exact=False)
    assert not _agrees({"acc": [0.5, 0.25]}, {"acc": [0.5004]}, exact=False)
    assert not _agrees({"acc": [0.5]}, {"loss": [0.5]}, exact=False)


DRIFT = {"offset": 0.0}


def _run(cell, seed):
    return {"metrics": {"acc": [0.5 + DRIFT["offset"], 0.25]}, "engine": "none", "data_checksum": "abc"}


CANARY = _repo.study(name="toy", title="Toy", protocol="v1", seeds=(0,), cells=TOY.cells, run=_run, report=_report,
                     canary=Cell("s", "A", {"lr": 0.1, "rounds": 2}), canary_seed=7)


def test_a_missing_canary_says_the_command_for_the_study_file(tmp_path):
    path = canary_path(tmp_path, "toy")
    for source, command in (("scripts/studies/toy.py", "fedhet-study canary scripts/studies/toy.py"),
                            (None, "fedhet-study canary STUDY")):
        study = dataclasses.replace(CANARY, source=source)
        assert rerun_canary(study, root=tmp_path) == [f"toy: no canary record {path}; write it with `{command}`"]


def test_a_drift_is_named_with_where_it_was_compared(tmp_path):
    """Same processor: the message names the key, the commit and the first difference only. Another processor: it
    adds the tolerance and both processors."""
    DRIFT["offset"] = 0.0
    try:
        record = write_canary(CANARY, root=tmp_path)
        commit, cpu = record["commit"], records_module.cpu_identity()
        DRIFT["offset"] = 0.01
        assert rerun_canary(CANARY, root=tmp_path) == [
            f"toy: canary metrics differs from the record made at {commit} (acc[0]: recorded 0.5, now 0.51)"]
        path = canary_path(tmp_path, "toy")
        stored = json.loads(path.read_text())
        stored["cpu"] = "Some Other CPU; AVX2"
        path.write_text(json.dumps(stored))
        assert rerun_canary(CANARY, root=tmp_path) == [
            f"toy: canary metrics differs from the record made at {commit} (acc[0]: recorded 0.5, now 0.51; "
            f"compared within 0.001 on {cpu}, which has no canary record of its own, not Some Other CPU; AVX2)"]
    finally:
        DRIFT["offset"] = 0.0


def _as_if_made_on(path, cpu, offset):
    stored = json.loads(path.read_text())
    stored["cpu"] = cpu
    stored["metrics"]["acc"][0] = 0.5 + offset
    path.write_text(json.dumps(stored))


def test_a_processors_own_record_is_compared_bit_for_bit_and_the_reference_within_the_tolerance(tmp_path):
    """The reference was made elsewhere and reads 0.5 + 2e-4 (inside 1e-3 (1 + 0.5)): with no record of this
    processor's own the re-run (0.5) agrees. A record of this processor's own that reads 0.5 + 1e-12 is then what
    the re-run is held to, bit for bit, and the message names it; written with ``this_processor`` it leaves the
    reference as it was and is exactly the re-run."""
    DRIFT["offset"] = 0.0
    reference = canary_path(tmp_path, "toy")
    cpu = records_module.cpu_identity()
    own = canary_path(tmp_path, "toy", cpu)
    assert own.name == f"canary.{records_module.slug(cpu)}.json" and own.parent == reference.parent
    record = write_canary(CANARY, root=tmp_path)
    _as_if_made_on(reference, "Some Other CPU; AVX2", 2e-4)
    assert rerun_canary(CANARY, root=tmp_path) == []
    own.write_text(reference.read_text())
    _as_if_made_on(own, cpu, 1e-12)
    assert rerun_canary(CANARY, root=tmp_path) == [
        f"toy: canary metrics differs from the record made at {record['commit']} "
        f"(acc[0]: recorded 0.500000000001, now 0.5)"]
    before = reference.read_text()
    write_canary(CANARY, root=tmp_path, this_processor=True)
    assert reference.read_text() == before
    assert json.loads(own.read_text())["metrics"] == {"acc": [0.5, 0.25]}
    assert rerun_canary(CANARY, root=tmp_path) == []


def test_refreshing_the_reference_removes_every_processors_own_record(tmp_path):
    """After a meant change the other processors' records hold the old numbers: a plain ``write_canary`` removes
    them; with no reference yet, ``this_processor`` writes the reference itself."""
    DRIFT["offset"] = 0.0
    reference = canary_path(tmp_path, "toy")
    write_canary(CANARY, root=tmp_path, this_processor=True)
    assert sorted(p.name for p in reference.parent.iterdir()) == ["canary.json"]
    other = canary_path(tmp_path, "toy", "Some Other CPU; AVX2")
    other.write_text(reference.read_text())
    write_canary(CANARY, root=tmp_path)
    assert sorted(p.name for p in reference.parent.iterdir()) == ["canary.json"]


def _run_numeric_checksum(cell, seed):
    return {"metrics": {"acc": [0.5]}, "engine": "none", "data_checksum": 0.5 + DRIFT["offset"]}


def test_the_data_checksum_is_exact_on_another_processor_whatever_its_type(tmp_path):
    """A run may report its data checksum as a number: on another processor a difference of 1e-6 (within the
    floats' tolerance) is still a different checksum."""
    study = dataclasses.replace(CANARY, run=_run_numeric_checksum)
    DRIFT["offset"] = 0.0
    try:
        write_canary(study, root=tmp_path)
        path = canary_path(tmp_path, "toy")
        stored = json.loads(path.read_text())
        stored["cpu"] = "Some Other CPU; AVX2"
        path.write_text(json.dumps(stored))
        assert rerun_canary(study, root=tmp_path) == []
        DRIFT["offset"] = 1e-6
        (problem,) = rerun_canary(study, root=tmp_path)
        assert problem.startswith("toy: canary data_checksum differs")
    finally:
        DRIFT["offset"] = 0.0
