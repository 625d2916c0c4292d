"""Declaring a study: cells (a setting x a method with its configuration), seeds, and how one run trains.

A :class:`Study` holds what the runner, the report and the check need and nothing about where it runs:

- ``cells``: the (setting, method) pairs, each with a JSON-able, fully resolved ``config``;
- ``seeds``: the seeds every cell runs (a run is one cell for one seed, and becomes one record);
- ``run(cell, seed) -> result``: trains one run; ``result`` is a dict with ``"metrics"`` (JSON-able: what the
  report reads) and ``"engine"`` (how it trained), and optionally ``"config"`` (what the run resolved beyond
  ``cell.config``; merged into the record's config), ``"data_checksum"``, ``"device"`` (where it trained, e.g.
  ``"cuda"``; default the CPU) and ``"note"`` (a sentence the runner shows once and does not record);
- ``run_seeds(cell, seeds) -> [result, ...]`` (optional): several seeds of one cell in one stacked run, each
  result equal to what ``run`` gives for that seed;
- ``report(records, out) -> [Summary, ...]``: writes ``out/<name>.md`` and its figures under ``out/<name>/``
  (default: the generic :class:`~lightning_fedhet.experiments.report.Report`).

:func:`~lightning_fedhet.experiments.federated.federated_study` writes ``run`` and ``run_seeds`` for the common case
(a function that builds the module, the data and the strategy for a cell and a seed).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightning_fedhet.experiments.decision import LABELS
from lightning_fedhet.experiments.records import Record, slug
from lightning_fedhet.experiments.stats import VERDICTS

RunFn = Callable[["Cell", int], dict]
RunSeedsFn = Callable[["Cell", Sequence[int]], list[dict]]
ReportFn = Callable[[list[Record], Path], list["Summary"]]


@runtime_checkable
class StudyBoundReport(Protocol):
    """A report that is bound to its study before use (the generic ``report.Report``: it reads the study's name,
    cells and seeds)."""

    def bind(self, study: Study) -> StudyBoundReport: ...


#: the factory of the report a study gets when it declares none; ``report.py`` (above this module) registers its
#: ``Report`` here, so this module never imports it
_DEFAULT_REPORT: list[Callable[[], StudyBoundReport]] = []


def set_default_report(factory: Callable[[], StudyBoundReport]) -> None:
    """Make ``factory()`` the report of every study constructed without one."""
    _DEFAULT_REPORT[:] = [factory]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One configuration of a study: ``setting`` x ``method``; ``config`` is JSON-able and fully resolved."""

    setting: str
    method: str
    config: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        slug(self.setting), slug(self.method)  # both must make file names
        try:
            json.dumps(self.config)
        except TypeError as error:
            raise TypeError(f"cell {self.setting}/{self.method}: config must be JSON-able ({error})") from None

    @property
    def name(self) -> str:
        return f"{self.setting} / {self.method}"


@dataclasses.dataclass(frozen=True)
class Summary:
    """One row of a results index: the claim, the paper's number, ours, and the verdict (all text)."""

    claim: str
    paper: str
    ours: str
    verdict: str

    def __post_init__(self) -> None:
        allowed = tuple(dict.fromkeys(LABELS + VERDICTS))  # the rule's labels, and v1/v2's registered ones
        if self.verdict.split(" (")[0] not in allowed:
            raise ValueError(f"verdict must start with one of {allowed}, got {self.verdict!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Study:
    """A study: cells x seeds, how one run trains, and the page its records give.

    Args:
        name: the study's name (records go under ``records/<name>/``, the page is ``<name>.md``).
        cells: its cells; (setting, method) pairs must be distinct.
        seeds: the seeds every cell runs by default.
        run: ``run(cell, seed) -> result`` (see the module docstring).
        run_seeds: ``run_seeds(cell, seeds) -> [result, ...]``, several seeds in one stacked run (optional).
        report: ``report(records, out) -> [Summary, ...]``; default: the generic
            :class:`~lightning_fedhet.experiments.report.Report` (a ``Report`` is bound to the study: its name,
            title, protocol and cell order). A report with a parameter ``root`` is called with the results folder
            the records come from too (to read other files kept there).
        title: a human name for pages (default: ``name``).
        protocol: the protocol version the runs are recorded under (``records/<name>/<protocol>/``).
        threads: torch's intra-op thread count for every run (records are bit for bit only at equal counts).
        canary: a cheap cell (a few rounds of one of the cells) whose one record ``check --rerun`` re-runs at the
            current code and compares bit for bit: the drift alarm for every number of the study.
        canary_seed: the canary's seed.
        code_paths: the paths (relative to the repository) whose uncommitted changes mark a record ``dirty``;
            empty: every tracked file.
        require_protocol: refuse to run before ``<root>/<name>/protocol-<protocol>.md`` exists (the rule of the
            paper reproductions: a protocol is committed before the runs it reports).
        root: the results folder records and pages go to when the caller names none (default ``./results``).
        source: how another process loads this study (a module path or a ``.py`` file, as :func:`load_study`
            takes it); :func:`load_study` fills it. Ray's workers use it when it is set.
    """

    name: str
    cells: tuple[Cell, ...]
    seeds: tuple[int, ...]
    run: RunFn
    run_seeds: RunSeedsFn | None = None
    report: ReportFn | None = None
    title: str = ""
    protocol: str = "v1"
    threads: int = 1
    canary: Cell | None = None
    canary_seed: int = 0
    code_paths: tuple[str, ...] = ()
    require_protocol: bool = False
    root: str | Path | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        slug(self.name), slug(self.protocol)
        object.__setattr__(self, "cells", tuple(self.cells))
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "code_paths", tuple(self.code_paths))
        object.__setattr__(self, "title", self.title or self.name)
        if not self.cells:
            raise ValueError(f"study {self.name}: no cells")
        keys = [(slug(c.setting), slug(c.method)) for c in self.cells]
        if len(set(keys)) != len(keys):
            raise ValueError(f"study {self.name}: duplicate (setting, method) cells")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"study {self.name}: seeds must be distinct, got {list(self.seeds)}")
        if int(self.threads) < 1:
            raise ValueError(f"study {self.name}: threads must be >= 1, got {self.threads}")
        report = self.report
        if report is None and _DEFAULT_REPORT:
            report = _DEFAULT_REPORT[0]()
        if isinstance(report, StudyBoundReport):
            report = report.bind(self)
        object.__setattr__(self, "report", report)

    @property
    def protocol_file(self) -> str:
        """The protocol's path relative to the results root."""
        return f"{self.name}/protocol-{self.protocol}.md"

    @property
    def settings(self) -> list[str]:
        """The settings in the order the cells first name them."""
        return list(dict.fromkeys(c.setting for c in self.cells))

    @property
    def methods(self) -> list[str]:
        """The methods in the order the cells first name them."""
        return list(dict.fromkeys(c.method for c in self.cells))

    def select(self, methods: Sequence[str] | None = None, settings: Sequence[str] | None = None) -> list[Cell]:
        """The cells of the given methods and settings (``None``: all); an unknown name fails, listing the cells."""
        for wanted, known, what in ((methods, self.methods, "method"), (settings, self.settings, "setting")):
            unknown = sorted(set(wanted or ()) - set(known))
            if unknown:
                raise ValueError(f"study {self.name} has no {what} {unknown}; {what}s: {known}")
        return [c for c in self.cells if (methods is None or c.method in methods)
                and (settings is None or c.setting in settings)]


def load_study(spec: str, attribute: str = "STUDY") -> Study:
    """The study a module path (``"mypackage.studies.sweep"``) or a Python file (``"studies/sweep.py"``) defines.

    ``spec`` may end with ``:NAME`` to read another attribute than ``STUDY``. A file is loaded as ``python FILE``
    would run it: its folder goes first on ``sys.path`` (so it may import the modules beside it). A file inside a
    package (its folder, and maybe the ones above, hold an ``__init__.py``) is imported as that package's module
    instead, with the folder above the outermost package on ``sys.path``, so it may import its siblings
    relatively (``from . import common``) and is the same module object as an ordinary import of it. The study
    returned knows its ``source``, so Ray's workers load it the same way.
    """
    target, _, name = spec.partition(":") if not _is_windows_drive(spec) else (spec, "", "")
    name = name or attribute
    if target.endswith(".py") or Path(target).is_file():
        path = Path(target).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no study file {target}")
        module = _import_from_package(path)
        if module is not None:
            return _study_of(module, spec, name, str(path))
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_name = f"_fedhet_study_{slug(path.stem).replace('-', '_').replace('.', '_')}"
        module = sys.modules.get(module_name)
        if module is None or getattr(module, "__file__", None) != str(path):
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        source = str(path)
    else:
        module = importlib.import_module(target)
        source = target
    return _study_of(module, spec, name, source)


def _study_of(module: Any, spec: str, name: str, source: str) -> Study:
    study = getattr(module, name, None)
    if not isinstance(study, Study):
        raise TypeError(f"{spec}: {name} must be a lightning_fedhet.experiments.Study, got {type(study).__name__}")
    return dataclasses.replace(study, source=source if name == "STUDY" else f"{source}:{name}")


def _import_from_package(path: Path) -> Any:
    """``path``'s module imported by its dotted name when its folder is a package (``None`` when it is not)."""
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1 or not all(part.isidentifier() for part in parts):
        return None
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    module = importlib.import_module(".".join(parts))
    if Path(getattr(module, "__file__", "") or "").resolve() != path:
        raise ImportError(f"{path}: importing {'.'.join(parts)} found {module.__file__} instead (another package "
                          f"of that name comes first on sys.path)")
    return module


def _is_windows_drive(spec: str) -> bool:
    return len(spec) > 2 and spec[1] == ":" and spec[2] in "\\/"


def resolve_root(study: Study, root: Any = None) -> Path:
    """The results folder: ``root`` if given, else the study's own ``root``, else ``./results``."""
    for candidate in (root, study.root):
        if candidate is not None:
            return Path(candidate)
    return Path("results")
