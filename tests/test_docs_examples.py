"""The code examples of the documentation site run as tests.

Every fenced block whose info string starts with ``python`` in ``docs/**/*.md`` (``docs/results/`` excluded: those
pages are generated from run records) is executed. The blocks of one page run in order in one namespace, so a later
block may use what an earlier one defined, as a reader would. Each page runs in a fresh temporary working directory
(Lightning's logs and checkpoints land there) with a fixed torch seed.

**Marking a block as not runnable.** Put the HTML comment ``<!-- skip-example -->`` on the line right before the
opening fence (it does not show on the site)::

    <!-- skip-example -->
    ```python
    trainer.fit(MyLightningModule(), datamodule=my_data)   # names the reader supplies
    ```

Use it only for snippets that need the reader's own objects, a GPU, several processes or a long run; everything
else should run (and assert what it claims). Blocks in other languages (``bash``, ``yaml``, ``text``) never run.
Fences may be indented (inside a list or an admonition); the indentation is removed before running.

The server-rule pages (``docs/algorithms/*.md``) are also checked against the code: their "Options" table must list
every constructor argument of the rules the page documents, with the signature's default.
"""

from __future__ import annotations

import inspect
import linecache
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"
EXCLUDED = ("results",)
SKIP_MARKER = "<!-- skip-example -->"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


@dataclass
class Block:
    """One fenced code block: the page, the 1-based line of its opening fence, its language and its source."""

    page: Path
    line: int
    language: str
    source: str
    skip: bool


def fenced_blocks(text: str, page: Path = Path("<text>")) -> list[Block]:
    """Every fenced code block of a Markdown text, in order (nested fences are not code blocks of their own)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence, info = match["indent"], match["fence"], match["info"].strip()
        language = re.split(r"[\s{]", info, maxsplit=1)[0].lower() if info else ""
        previous = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        body: list[str] = []
        j = i + 1
        # The block ends at a line holding only the same fence character, at least as long (CommonMark).
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        source = textwrap.dedent("\n".join(body)) + "\n"
        blocks.append(Block(page, i + 1, language, source, previous == SKIP_MARKER))
        i = j + 1
    return blocks


def runnable_blocks(page: Path) -> list[Block]:
    return [b for b in fenced_blocks(page.read_text(encoding="utf-8"), page) if b.language == "python" and not b.skip]


def doc_pages() -> list[Path]:
    pages = sorted(DOCS.rglob("*.md"))
    return [p for p in pages if p.relative_to(DOCS).parts[0] not in EXCLUDED]


PAGES = [p for p in doc_pages() if runnable_blocks(p)]


def test_pages_with_examples_are_found():
    """Slip: a wrong docs path or a fence pattern that matches nothing makes the parametrised test vanish."""
    names = {p.relative_to(DOCS).as_posix() for p in PAGES}
    assert {"getting-started.md", "algorithms/fedavg.md"} <= names


def test_fenced_blocks_parse_skip_marker_indent_and_longer_fences():
    """Hand-written page: the skip marker applies to the next block only, indented fences are dedented, a ````
    fence holds a ``` line, and other languages are kept apart. Slip: the marker skipping every later block, or an
    indented block keeping its indentation (an IndentationError on the site's admonition examples)."""
    text = "\n".join(
        [
            "# page",
            "<!-- skip-example -->",
            "",
            "```python",
            "raise RuntimeError('skipped')",
            "```",
            "```python {.no-copy}",
            "x = 1",
            "```",
            "!!! note",
            "    ```python",
            "    if x:",
            "        y = 2",
            "    ```",
            "````markdown",
            "```python",
            "not code",
            "```",
            "````",
            "```bash",
            "echo hi",
            "```",
        ]
    )
    blocks = fenced_blocks(text)
    assert [(b.line, b.language, b.skip) for b in blocks] == [
        (4, "python", True),
        (7, "python", False),
        (11, "python", False),
        (15, "markdown", False),
        (20, "bash", False),
    ]
    assert blocks[2].source == "if x:\n    y = 2\n"
    namespace: dict = {}
    for block in blocks:
        if block.language == "python" and not block.skip:
            exec(compile(block.source, "<text>", "exec"), namespace)
    assert namespace["y"] == 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__docs__"}
    for block in runnable_blocks(page):
        where = f"{page.relative_to(DOCS.parent)}:{block.line}"
        # Blank lines first so that a traceback's line numbers are the page's own; linecache lets it show them.
        source = "\n" * block.line + block.source
        linecache.cache[where] = (len(source), None, source.splitlines(keepends=True), where)
        exec(compile(source, where, "exec"), namespace)


# ----------------------------------------------------------------------------------------- rule pages' options
RULE_PAGES = {
    "algorithms/fedavg.md": ["FedAvg"],
    "algorithms/fedvarp.md": ["FedVARP"],
    "algorithms/mifa.md": ["MIFA"],
    "algorithms/fedstale.md": ["FedStale"],
    "algorithms/fedau.md": ["FedAU"],
    "algorithms/upgapl.md": ["UPGAPL", "DMAPL", "UDMAPL"],
    "algorithms/fednova.md": ["FedNova"],
    "algorithms/cafed.md": ["CAFed", "AdaFed", "F3AST"],
    "algorithms/fedacs.md": ["FedACS", "SampledFedAvg", "CAFedAvg", "OS"],
    "algorithms/fedcis.md": ["FedCIS"],
    "algorithms/fedast.md": ["FedAST", "SyncST"],
}
_NO_DEFAULT = "(required)"


def _rule_class(name: str):
    from lightning_fedhet import algorithms, asynchronous

    return getattr(algorithms, name, None) or getattr(asynchronous, name)


def _parameters(cls) -> dict:
    params = inspect.signature(cls.__init__).parameters
    return {n: p.default for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD}


def options_rows(text: str) -> list[tuple[str | None, list[str], list[str]]]:
    """``(rule, option names, default cells)`` of every row of the page's "## Options" table.

    Tables with a leading ``rule`` column name the class in that column (empty: the row above's class)."""
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    has_rule = header[0] == "rule"
    out, rule = [], None
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if has_rule:
            rule = cells[0].strip("`") or rule
            cells = cells[1:]
        names = re.findall(r"`([^`]*)`", cells[0])
        defaults = [_NO_DEFAULT] if cells[1] == _NO_DEFAULT else re.findall(r"`([^`]*)`", cells[1])
        out.append((rule, names, defaults))
    return out


@pytest.mark.parametrize("page", sorted(RULE_PAGES))
def test_rule_page_documents_every_constructor_argument_and_its_default(page: str):
    """Each rule page's Options table names every constructor argument with the signature's default, and names
    nothing else. Slips: an argument added to a rule but not to its page, a renamed argument, a changed default
    (e.g. FedStale's ``weighting``) left stale on the page."""
    text = (DOCS / page).read_text(encoding="utf-8")
    rows = options_rows(text)
    documented: dict[str, set[str]] = {name: set() for name in RULE_PAGES[page]}
    single = RULE_PAGES[page][0] if len(RULE_PAGES[page]) == 1 else None
    for rule, names, defaults in rows:
        cls_name = rule or single
        params = _parameters(_rule_class(cls_name))
        for name in names:
            assert name in params, f"{page}: {cls_name} has no argument {name!r}"
            documented[cls_name].add(name)
        if len(defaults) == 1 and len(names) > 1:
            defaults = defaults * len(names)
        if len(defaults) != len(names):
            continue  # "as above": defaults given in an earlier row
        for name, cell in zip(names, defaults):
            default = params[name]
            if cell == _NO_DEFAULT:
                assert default is inspect.Parameter.empty, f"{page}: {cls_name}({name}) has a default {default!r}"
            else:
                expected = eval(cell, {"torch": torch})  # the page's literal, e.g. `"known"`, `torch.float32`
                assert expected == default, f"{page}: {cls_name}({name}=...) default is {default!r}, page says {cell}"
    for cls_name, names in documented.items():
        missing = set(_parameters(_rule_class(cls_name))) - names
        assert not missing, f"{page}: arguments of {cls_name} missing from the Options table: {sorted(missing)}"
