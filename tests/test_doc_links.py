"""Every ``docs/<file>.md#<anchor>`` a docstring or comment cites names a heading of that file:
a rule's citation must lead to the rule (docs/README.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("sim", "kvtwin", "traces", "reports", "executor", "kernels", "tests", "bench", "scripts")
LINK = re.compile(r"docs/([a-z_]+)\.md#([A-Za-z0-9_-]+)")


def _slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in doc.read_text().splitlines() if line.startswith("#")}


def _links() -> list[tuple[str, str, str]]:
    found = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for doc, anchor in LINK.findall(path.read_text()):
                found.append((str(path.relative_to(ROOT)), doc, anchor))
    return found


def test_the_slug_is_the_renderers():
    assert _slug("Retention sliding window") == "retention-sliding-window"
    assert _slug("Hash of one block") == "hash-of-one-block"


def test_every_cited_anchor_exists():
    anchors = {doc.stem: _anchors(doc) for doc in (ROOT / "docs").glob("*.md")}
    links = _links()
    assert len(links) > 50  # the rules are cited
    missing = [f"{where}: docs/{doc}.md#{anchor}" for where, doc, anchor in links
               if anchor not in anchors.get(doc, set())]
    assert missing == []
