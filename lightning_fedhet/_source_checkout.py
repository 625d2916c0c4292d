"""The package importable from a source checkout that is not installed (``PYTHONPATH=<repo>``, no ``pip install``).

Two subpackages of the namespace live at the top of the repository, not in ``lightning_fedhet/``: ``callbacks/`` and
``model_zoo/`` are ``lightning_fedhet.callbacks`` and ``lightning_fedhet.model_zoo`` because pyproject.toml's
``[tool.setuptools.package-dir]`` maps them there; an install (a wheel copies them into ``lightning_fedhet/``, an
editable install adds a finder for them) is what makes the mapping real. Without one, ``import lightning_fedhet``
failed with "No module named 'lightning_fedhet.callbacks'".

:func:`install` (run when the package's ``__init__`` imports this module, first) does what the editable install's
finder does for exactly those two names: when ``lightning_fedhet/`` has no such folder and the repository's top has
it, a finder at the end of ``sys.meta_path`` (after any install's own finder) loads the package from there; its
submodules follow through the package's ``__path__``. Installed as a wheel, the folders are inside
``lightning_fedhet/`` and nothing is added.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

#: namespace package -> folder at the repository's top (pyproject.toml's ``[tool.setuptools.package-dir]``, which a
#: test keeps equal to this table)
MAPPED_FOLDERS = {"lightning_fedhet.callbacks": "callbacks", "lightning_fedhet.model_zoo": "model_zoo"}


class SourceCheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds each package of ``folders`` (name -> its folder holding ``__init__.py``) and nothing else."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = dict(folders)

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def unmapped_folders(package_folder: Path) -> dict[str, Path]:
    """The mapped packages that ``package_folder`` (the folder of ``lightning_fedhet/__init__.py``) lacks and that sit
    beside it, as in a source checkout; ``{}`` when installed as a wheel."""
    top = package_folder.parent
    return {
        name: top / folder
        for name, folder in MAPPED_FOLDERS.items()
        if not (package_folder / name.rpartition(".")[2]).is_dir() and (top / folder / "__init__.py").is_file()
    }


def install(package_folder: Path) -> None:
    """Append a :class:`SourceCheckoutFinder` for :func:`unmapped_folders` to ``sys.meta_path`` (once)."""
    folders = unmapped_folders(package_folder)
    if folders and not any(isinstance(finder, SourceCheckoutFinder) for finder in sys.meta_path):
        sys.meta_path.append(SourceCheckoutFinder(folders))


install(Path(__file__).resolve().parent)
