"""A source checkout that is not installed imports: ``lightning_fedhet.callbacks`` and ``.model_zoo`` come from the
repository's top-level ``callbacks/`` and ``model_zoo/`` (pyproject's ``package-dir``), as an install maps them.

The test process itself runs with the editable install, whose finder would answer for these names; the checkout case
runs in a subprocess started with ``-I -S`` (no site: no ``.pth`` file, so no editable finder), from a temporary
folder, with the repository and the bare site-packages folder (for torch and Lightning) put on ``sys.path`` by hand.
A control run with this module's finder switched off shows that such a process does fail without it.
"""

from __future__ import annotations

import re
import site
import subprocess
import sys
from pathlib import Path

from lightning_fedhet._source_checkout import MAPPED_FOLDERS, SourceCheckoutFinder, unmapped_folders

REPO = Path(__file__).resolve().parents[1]


def test_the_mapped_folders_are_pyprojects():
    table = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    assert dict(re.findall(r'^"([\w.]+)"\s*=\s*"([\w./]+)"', table, flags=re.M)) == MAPPED_FOLDERS


def _layout(root: Path, inside: bool) -> Path:
    """A package folder with ``callbacks``/``model_zoo`` inside it (a wheel) or beside it (a checkout)."""
    package = root / "lightning_fedhet"
    package.mkdir()
    for folder in MAPPED_FOLDERS.values():
        (package / folder if inside else root / folder).mkdir()
        ((package / folder if inside else root / folder) / "__init__.py").write_text("")
    return package


def test_only_a_checkout_gets_the_finder(tmp_path):
    (tmp_path / "wheel").mkdir()
    (tmp_path / "checkout").mkdir()
    assert unmapped_folders(_layout(tmp_path / "wheel", inside=True)) == {}
    checkout = _layout(tmp_path / "checkout", inside=False)
    assert unmapped_folders(checkout) == {
        "lightning_fedhet.callbacks": tmp_path / "checkout" / "callbacks",
        "lightning_fedhet.model_zoo": tmp_path / "checkout" / "model_zoo",
    }


def test_the_finder_answers_for_its_packages_only(tmp_path):
    checkout = _layout(tmp_path, inside=False)
    finder = SourceCheckoutFinder(unmapped_folders(checkout))
    spec = finder.find_spec("lightning_fedhet.callbacks")
    assert spec.origin == str(tmp_path / "callbacks" / "__init__.py")
    assert spec.submodule_search_locations == [str(tmp_path / "callbacks")]
    assert finder.find_spec("lightning_fedhet.callbacks.media") is None  # found through the package's __path__
    assert finder.find_spec("lightning_fedhet.strategy") is None
    assert finder.find_spec("callbacks") is None


_IMPORT = """
import sys
sys.path[:0] = [{repo!r}]
sys.path.append({site!r})
assert not any("Editable" in getattr(f, "__name__", type(f).__name__) for f in sys.meta_path), sys.meta_path
{before}
import lightning_fedhet.callbacks, lightning_fedhet.model_zoo
from lightning_fedhet.callbacks.round_metrics import RoundMetrics
from lightning_fedhet.model_zoo import create
print(lightning_fedhet.__file__)
print(lightning_fedhet.callbacks.__file__)
print(lightning_fedhet.model_zoo.__file__)
"""


def _run_uninstalled(tmp_path: Path, before: str = "") -> subprocess.CompletedProcess:
    site_packages = next(p for p in site.getsitepackages() if Path(p, "torch").is_dir())
    code = _IMPORT.format(repo=str(REPO), site=site_packages, before=before)
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)


def test_a_checkout_without_an_install_imports(tmp_path):
    done = _run_uninstalled(tmp_path)
    assert done.returncode == 0, done.stderr
    folders = ["lightning_fedhet", "callbacks", "model_zoo"]
    assert done.stdout.split() == [str(REPO / folder / "__init__.py") for folder in folders]


def test_without_the_finder_that_process_fails_as_it_did(tmp_path):
    """The control: the subprocess really has no install to fall back on."""
    off = "import types; sys.modules['lightning_fedhet._source_checkout'] = types.ModuleType('off')"
    done = _run_uninstalled(tmp_path, before=off)
    assert done.returncode != 0
    assert "No module named 'lightning_fedhet.callbacks'" in done.stderr
