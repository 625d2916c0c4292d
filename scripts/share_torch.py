"""Let a second virtual environment use the PyTorch that ``.venv`` already holds, instead of a copy of its own.

    .venv/bin/python scripts/share_torch.py TARGET_VENV

PyTorch's Linux wheel with the CUDA libraries it needs is about 5.5 GB installed; CI builds three environments
(``.venv``, the wheel check's fresh one, ``.venv-flower``), and a third copy has filled a CI machine's disk. This
links (symbolic links, no copies) PyTorch's family as this interpreter has it installed --- torch, torchvision
and the ``nvidia-*``, ``cuda-*`` and triton packages they require --- into ``TARGET_VENV/shared-torch/`` and puts
that folder on the target's ``sys.path`` with a ``.pth`` file, *after* its own site-packages. pip then finds
``torch==2.14.1`` (or whatever constraints.txt pins) already installed and installs only the rest. The pins are
the same in every environment, so the environment is the one ``pip install`` would have made; a package the
target's constraints pin differently would be installed into the target's own site-packages, ahead of the link.

Idempotent: running it again replaces the links.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

#: the distributions that may be shared, by normalized name (PEP 503): the heavy part of PyTorch's family
HEAVY = re.compile(r"^(torch|torchvision|triton|nvidia-.+|cuda-.+)$")


def family_entries(site: Path) -> set[str]:
    """Top-level names in ``site`` (package folders, modules, ``.dist-info`` folders) of PyTorch's family.

    The family is torch and torchvision with what they require, extras and markers evaluated here, as far as it
    is :data:`HEAVY`: the CUDA libraries and triton, not the small pure-Python packages (sympy, filelock, ...),
    which the target installs itself, nor an ``nvidia-*`` package that only something else asks for.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dists = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(site)])}
    todo, seen = [("torch", frozenset()), ("torchvision", frozenset())], set()
    while todo:
        name, extras = todo.pop()
        if name not in dists or (name, extras) in seen:
            continue
        seen.add((name, extras))
        for line in dists[name].requires or ():
            requirement = Requirement(line)
            wanted = requirement.marker is None or any(
                requirement.marker.evaluate({"extra": extra}) for extra in extras | {""})
            dependency = canonicalize_name(requirement.name)
            if wanted and HEAVY.match(dependency):
                todo.append((dependency, frozenset(requirement.extras)))
    entries: set[str] = set()
    for name in {name for name, _ in seen}:
        for file in dists[name].files or ():
            top = Path(file).parts[0]
            if top != ".." and (site / top).exists():  # scripts installed into bin/ stay out
                entries.add(top)
    return entries


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(sys.argv[1]).resolve()
    site = Path(sysconfig.get_path("purelib"))
    entries = family_entries(site)
    if not any(e.startswith("torch-") for e in entries):
        print(f"share_torch: no torch in {site}; nothing shared", file=sys.stderr)
        return 1
    target_site = Path(subprocess.run([str(target / "bin" / "python"), "-c",
                                       "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                      capture_output=True, text=True, check=True).stdout.strip())
    shared = target / "shared-torch"
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir()
    for entry in sorted(entries):
        (shared / entry).symlink_to(site / entry)
    (target_site / "fedhet-shared-torch.pth").write_text(f"{shared}\n")
    print(f"share_torch: {len(entries)} entries of {site} linked into {shared}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
