"""Acceptance: the quickstart (100 clients, Dirichlet 0.5, 10 per round) reaches >= 80 % test accuracy.

Runs examples/quickstart.py exactly as the README's command (a) does, with its defaults. About two minutes
on a 2-core CPU; skipped when Fashion-MNIST is not installed.
"""

import re
import subprocess
import sys
from pathlib import Path

from tests.test_cli import needs_fmnist

ROOT = Path(__file__).resolve().parents[2]


@needs_fmnist
def test_quickstart_reaches_80_percent(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--save-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rounds = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 80 and rounds[-1].startswith("round   80/80")
    match = re.search(r"final test accuracy (\d\.\d+) after 80 rounds", result.stdout)
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) >= 0.80
