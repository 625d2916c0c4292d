"""The package's import graph, as installed: no import circle, no arrow up the declared layers, no oversized file.

An AST scan of every module of the wheel's ``lightning_fedhet`` namespace (``callbacks/`` and ``model_zoo/`` included:
pyproject's ``[tool.setuptools.package-dir]`` installs them as ``lightning_fedhet.callbacks`` and
``lightning_fedhet.model_zoo``), counting every import statement: function-level, ``TYPE_CHECKING`` and relative ones
too. ``from package import name`` is an arrow to the submodule ``package.name`` when that is a module, else to the
package's ``__init__``.

A *part* is a top-level module (``spec``, ``server``, ...) or a subpackage (``engines``, ``algorithms``, ...; the
package's own ``__init__`` is the part ``__init__``, its public face). :data:`LAYERS` lists the parts from the bottom
up, read from the code as it is; a part may import only parts of lower layers (inside a part, any module may import
another, as long as no circle forms).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_fedhet"

#: the parts of the package, bottom layer first; a part imports only parts of the layers below its own
LAYERS: list[set[str]] = [
    # the argument checks (every other part validates its input with them)
    {"_checks"},
    # leaves: the seed, the flat view of a module, the CIS topology, plain torch.nn models; the source checkout's
    # finder for the mapped folders; the device a strategy follows (the Trainer's unless given)
    {"_third_party", "seeding", "flat", "cis", "model_zoo", "_source_checkout", "trainer_device"},
    # who is available, what the links and the clock do, the clients' data
    {"participation", "system", "data"},
    # the server rules; the logged configuration's pieces; the ready-made LightningModules (on model_zoo);
    # the asynchronous FedAST simulation (its own scheduler on participation, system and data)
    {"algorithms", "config_summary", "classifier", "early_exit_module", "asynchronous"},
    # the round planner: availability -> selection -> links -> local steps -> clock
    {"federation"},
    # the round records; which process trains which client
    {"history", "distributed"},
    # the round: plan, global model, accepting updates, checkpoint state (no Lightning)
    {"server"},
    # how a round's local training runs, and which engine a fit gets
    {"engines"},
    # every setting of a run, checked once; builds the server
    {"spec"},
    # the strategies' public face; the Flower bridge (spec and server, never the Lightning strategies)
    {"federated_run", "flower"},
    # the round callbacks (they read a run through federated_run)
    {"callbacks"},
    # the Lightning plumbing every strategy shares
    {"strategy_base"},
    # the strategies
    {"strategy", "strategy_ddp"},
    # the package's public face
    {"__init__"},
    # many seeds as one run; the command line
    {"multiseed", "cli"},
    # studies, records and reports
    {"experiments"},
]

#: library files over :data:`MAX_LINES` lines, each with why it stays whole for now
LONG_FILES: dict[str, str] = {}
MAX_LINES = 450


def mapped_folders() -> dict[str, Path]:
    """The wheel's ``lightning_fedhet`` namespace: module prefix -> folder (pyproject's ``package-dir`` table)."""
    table = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    folders = {PACKAGE: REPO / PACKAGE}
    for name, folder in re.findall(r'^"([\w.]+)"\s*=\s*"([\w./]+)"', table, flags=re.M):
        folders[name] = REPO / folder
    return folders


def library_modules() -> dict[str, Path]:
    """Every module of the namespace, by its installed name."""
    folders = mapped_folders()
    modules = {}
    for prefix, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            name = ".".join((prefix, *path.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__")
            if not any(name.startswith(f"{other}.") or name == other for other in folders if other != prefix
                       and other.startswith(f"{prefix}.")):  # a mapped folder's copy under the package, if any
                modules[name] = path
    return modules


def imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The namespace's modules that ``module`` (at ``path``) imports, anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names)
    found.discard(None)
    found.discard(module)
    return found


def graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {module: imports(path, module, modules) for module, path in modules.items()}


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_scan_reads_the_installed_namespace_and_every_kind_of_import():
    modules = library_modules()
    assert {"lightning_fedhet.callbacks.round_metrics", "lightning_fedhet.model_zoo.early_exit",
            "lightning_fedhet.engines.vmap", "lightning_fedhet"} <= set(modules)
    assert not any(name.startswith(("lightning_fedhet.lightning_fedhet", "callbacks", "model_zoo")) for name in modules)
    edges = graph()
    # a mapped folder is reached under its installed name
    assert "lightning_fedhet.callbacks.round_metrics" in edges["lightning_fedhet.strategy_base"]
    assert "lightning_fedhet.model_zoo" in edges["lightning_fedhet.classifier"]
    assert "lightning_fedhet.engines.registry" in edges["lightning_fedhet.spec"]
    # ``from lightning_fedhet.engines import registry`` style: the submodule, not the package face
    assert "lightning_fedhet.engines._compiled" in edges["lightning_fedhet.engines.cohort"]


def test_the_scan_finds_a_circle_and_reads_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from ..server import Server\n    from . import base\n")
    modules = {"lightning_fedhet.server": Path(), "lightning_fedhet.engines.base": Path(),
               "lightning_fedhet.engines.mod": source}
    assert imports(source, "lightning_fedhet.engines.mod", modules) == {"lightning_fedhet.server",
                                                                          "lightning_fedhet.engines.base"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_modules():
    edges = graph()
    found = circles(edges)
    detail = [" -> ".join(f"{a}->{b}" for a in c for b in sorted(edges[a]) if b in c) for c in found]
    assert found == [], detail


def test_every_part_has_a_layer_and_no_import_runs_up_or_sideways():
    layer = {name: level for level, names in enumerate(LAYERS) for name in names}
    edges = graph()
    parts = {part(module) for module in edges}
    assert parts - set(layer) == set(), "new parts: give each a layer in LAYERS"
    assert set(layer) - parts == set(), "LAYERS names parts that no longer exist"
    wrong = sorted(
        f"{module} -> {target} ({part(module)}, layer {layer[part(module)]} -> {part(target)}, layer "
        f"{layer[part(target)]})"
        for module, targets in edges.items()
        for target in targets
        if part(module) != part(target) and layer[part(target)] >= layer[part(module)]
    )
    assert wrong == []


def test_no_library_file_is_over_the_line_limit():
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines())
             for path in library_modules().values()}
    over = {path: lines for path, lines in sizes.items() if lines > MAX_LINES and path not in LONG_FILES}
    assert over == {}, f"split by idea, or list the file in LONG_FILES with the reason it stays whole: {over}"
    stale = {path for path in LONG_FILES if sizes.get(path, 0) <= MAX_LINES}
    assert stale == set(), "LONG_FILES lists files that are no longer over the limit"
