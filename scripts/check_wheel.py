"""Import every module of the source tree from an installed wheel, outside the source tree.

Run by ``scripts/check_wheel.sh`` with the fresh environment's interpreter in isolated mode (``python -I``, so
neither the current folder nor this script's folder is on ``sys.path``)::

    python -I scripts/check_wheel.py SOURCE_ROOT

The module list is read from the source tree's files (``lightning_fedhet/**.py`` and the folders that
``pyproject.toml`` maps into the namespace), so a package the wheel leaves out fails here by name. Every module
must load from site-packages, never from ``SOURCE_ROOT``. ``lightning_fedhet.flower`` needs the ``[flower]`` extra:
without Flower its files must be in the wheel but are not run (``scripts/ci_flower.sh`` runs them).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

#: source folder -> the package name it installs as (pyproject.toml's package-dir)
FOLDERS = {"lightning_fedhet": "lightning_fedhet", "model_zoo": "lightning_fedhet.model_zoo",
           "callbacks": "lightning_fedhet.callbacks"}


def source_modules(root: Path) -> list[str]:
    names = []
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join([package, *parts]))
    return names


def main() -> int:
    root = Path(sys.argv[1]).resolve()
    failures = []
    modules = source_modules(root)
    installed = {f.as_posix() for f in importlib.metadata.files("lightning-fedhet")}
    for name in modules:
        if name.split(".")[:2] == ["lightning_fedhet", "flower"] and importlib.util.find_spec("flwr") is None:
            # the [flower] extra is not installed here: the module must be in the wheel, but cannot run
            if not installed & {name.replace(".", "/") + ".py", name.replace(".", "/") + "/__init__.py"}:
                failures.append(f"{name}: missing from the wheel")
            continue
        try:
            module = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - report every failure, not only the first
            failures.append(f"{name}: {type(error).__name__}: {error}")
            continue
        origin = Path(module.__file__).resolve()
        if root in origin.parents:
            failures.append(f"{name}: imported from the source tree ({origin}), not from the wheel")
    if failures:
        print("wheel check failed:\n  " + "\n  ".join(failures))
        return 1
    import lightning_fedhet

    print(f"wheel check: {len(modules)} modules import from {Path(lightning_fedhet.__file__).parent} "
          f"(lightning-fedhet {lightning_fedhet.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
