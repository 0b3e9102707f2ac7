"""The user-facing documentation: README.md, the front door, the pages under docs/, and
CONTRIBUTING.md.

Tests that run or check the documents' code blocks read them through here, so a block
moved from the README into a page stays tested.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
CONTRIBUTING = REPO / "CONTRIBUTING.md"


def pages() -> list[Path]:
    """README.md, then every docs/*.md in name order, then CONTRIBUTING.md."""
    return [README, *sorted(DOCS.glob("*.md")), CONTRIBUTING]


def code_blocks(lang: str, page: Path | None = None) -> list[tuple[Path, str]]:
    """Every ```lang fenced block of one page, or of all pages: (page, text) pairs."""
    out = []
    for path in [page] if page else pages():
        out += [
            (path, block)
            for block in re.findall(
                rf"^ *```{lang}\n(.*?)^ *```", path.read_text(), re.DOTALL | re.MULTILINE
            )
        ]
    return out


def section(page: Path, heading: str) -> str:
    """The text under a `## heading` of `page`, up to the next `## ` heading."""
    match = re.search(
        rf"^## {re.escape(heading)}\n(.*?)^## ", page.read_text(), re.MULTILINE | re.DOTALL
    )
    assert match, f'{page.name} has no "## {heading}" section followed by another'
    return match[1]
