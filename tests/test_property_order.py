"""A derandomized property test draws the same examples whatever was imported before it.

Hypothesis (>= 6.131) mixes into its draws literals collected from every local module in ``sys.modules``, so a
module imported by an earlier test (or by collecting another test file) changed what the property tests drew: the
twelve files that mention FedStale, run in a row, drew ``FedCIS(aggregation_base=np.empty((1, 0)))`` where the
property file alone never did. ``tests/conftest.py`` empties that pool; this test fails if it stops doing so (a
Hypothesis upgrade that renames what it patches, or the patch removed). ``scripts/ci_property_order.sh`` runs the
property files themselves in reverse and shuffled order.
"""

from __future__ import annotations

import importlib.util
import sys

from hypothesis import Phase, given, settings
from hypothesis import strategies as st

#: literals of a module the property tests never import: 60 integers, 60 floats and 60 strings
PROBE = "\n".join(
    [f"I{k} = {7_000_003 + 104_729 * k}" for k in range(60)]
    + [f"F{k} = {0.123456789 + 0.917 * k!r}" for k in range(60)]
    + [f"S{k} = 'fedhet-probe-{k}'" for k in range(60)]
)


def _draws() -> list[str]:
    """The examples of one derandomized run (200 integers, floats and strings), as reprs (nan != nan)."""
    seen: list[str] = []

    @settings(max_examples=200, database=None, derandomize=True, deadline=None, phases=[Phase.generate])
    @given(st.integers(), st.floats(), st.text(max_size=6))
    def record(i, x, s):
        seen.append(repr((i, x, s)))

    record()
    return seen


def test_draws_do_not_depend_on_the_modules_imported_before(tmp_path):
    before = _draws()
    path = tmp_path / "fedhet_order_probe.py"
    path.write_text(PROBE + "\n")
    spec = importlib.util.spec_from_file_location("fedhet_order_probe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        after = _draws()
    finally:
        del sys.modules[spec.name]
    assert len(before) == len(after) == 200
    changed = sum(a != b for a, b in zip(before, after))
    assert changed == 0, f"{changed} of 200 draws changed after importing a module with new literals"
