"""Which way the imports go: the library never imports ``lightning_fedhet.experiments``, and the package never
imports the repository's own studies or tools (``scripts/``: the paper studies are its plug-ins, not its parts).

An AST scan of every import statement, function-level ones included, with relative imports resolved.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lightning_fedhet"
#: folders the wheel maps into the lightning_fedhet namespace (pyproject's package-dir)
MAPPED = {REPO / "model_zoo": "lightning_fedhet.model_zoo", REPO / "callbacks": "lightning_fedhet.callbacks"}


def imports(path: Path, module: str) -> list[str]:
    """Every module name ``path`` (the module ``module``) imports, anywhere in it, relative ones made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return found


def library_modules():
    """``(path, module name)`` of every module of the wheel's ``lightning_fedhet`` namespace."""
    for folder, name in ((PACKAGE, "lightning_fedhet"), *MAPPED.items()):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            yield path, ".".join((name, *parts)).removesuffix(".__init__")


def repository_only_names() -> set[str]:
    """Top-level names that exist only in this repository's checkout: its folders beside the package and every
    module or package under scripts/ (studies, referee, reproduce, gpu, ...)."""
    names = {"scripts", "tests", "benchmarks", "examples", "docs", "harness"}
    for path in (REPO / "scripts").iterdir():
        if path.suffix == ".py" or (path.is_dir() and not path.name.startswith((".", "_"))):
            names.add(path.stem)
    return names


def test_the_library_outside_experiments_never_imports_experiments():
    found = [f"{path.relative_to(REPO)} imports {name}" for path, module in library_modules()
             if not module.startswith("lightning_fedhet.experiments")
             for name in imports(path, module)
             if name == "lightning_fedhet.experiments" or name.startswith("lightning_fedhet.experiments.")]
    assert found == []


def test_experiments_never_imports_the_studies_or_other_repository_code():
    banned = repository_only_names()
    assert {"studies", "referee", "reproduce"} <= banned
    found = [f"{path.relative_to(REPO)} imports {name}" for path, module in library_modules()
             if module.startswith("lightning_fedhet.experiments")
             for name in imports(path, module) if name.split(".")[0] in banned]
    assert found == []


def test_the_scan_sees_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from ..experiments import report\n    import studies.fedau\n")
    names = imports(source, "lightning_fedhet.engines.mod")
    assert "lightning_fedhet.experiments" in names and "lightning_fedhet.experiments.report" in names
    assert "studies.fedau" in names
