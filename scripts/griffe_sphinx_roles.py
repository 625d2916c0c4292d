"""Griffe extension used by the documentation build (mkdocs.yml): Sphinx markup in docstrings, shown as Markdown.

The docstrings are Google style with a few reStructuredText habits that Markdown would print literally:

- roles such as :class:`~lightning_fedhet.algorithms.FedAvg` or :meth:`setup` become inline code (`FedAvg`,
  `setup`: the last component when the target starts with ``~``, as Sphinx shows it);
- a paragraph ending in ``::`` before an indented code block ends in ``:``, and a lone ``Example::`` line becomes a
  bold label (a plain ``Example:`` line would start a Google "Examples" section and change how the block parses).

Only the rendered text changes; the docstrings themselves stay as they are for ``help()`` and IDEs.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|obj|exc|py:\w+):`(~?)([^`]+)`")
_LONE_LABEL = re.compile(r"^([ \t]*)([A-Z]\w*(?: \w+)*)::[ \t]*$", re.MULTILINE)
_TRAILING = re.compile(r"::[ \t]*$", re.MULTILINE)


def _role(match: re.Match) -> str:
    target = match[2]
    return f"`{target.rsplit('.', 1)[-1] if match[1] else target.lstrip('.')}`"


def markdown_text(text: str) -> str:
    """``text`` with the Sphinx roles and ``::`` literal-block markers rewritten (see the module docstring)."""
    text = _ROLE.sub(_role, text)
    text = _LONE_LABEL.sub(r"\1**\2:**", text)
    return _TRAILING.sub(":", text)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring with :func:`markdown_text` as griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_text(obj.docstring.value)
