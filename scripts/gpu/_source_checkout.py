"""Import ``lightning_fedhet`` from a copied source tree that was never installed (the device machine: no pip
install, no internet).

``model_zoo/`` and ``callbacks/`` sit at the top of the repository and install as ``lightning_fedhet.model_zoo``
and ``lightning_fedhet.callbacks`` (``setup.py``, ``[tool.setuptools.package-dir]``); on ``PYTHONPATH=.`` alone the
package's ``__init__`` fails with "No module named 'lightning_fedhet.callbacks'". :func:`install` appends an import
finder that maps exactly those two names to their folders, as an editable install's finder does. It is appended
*last*, so an installed package (an editable install included) is found first and the finder never acts there.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: package name -> folder under the repository root (setup.py's MAPPED)
MAPPED = {"lightning_fedhet.model_zoo": "model_zoo", "lightning_fedhet.callbacks": "callbacks"}


class _MappedPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        folder = MAPPED.get(name)
        if folder is None:  # submodules are found through the package's __path__ by the ordinary finder
            return None
        return importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])


def install() -> None:
    """Put the repository root on ``sys.path`` and append the finder (once per process)."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    if not any(isinstance(f, _MappedPackages) for f in sys.meta_path):
        sys.meta_path.append(_MappedPackages())
