"""Every ``<file>.md#<anchor>`` the repository cites names a heading of that file: a rule's
citation must lead to the rule (docs/README.md).

Two forms are checked, in code (docstrings, comments, TOML comments) and in every Markdown
file alike: a bare citation such as ``docs/capacity.md#the-band`` is read from the
repository root; a Markdown link ``[text](capacity.md#the-band)`` from the folder of the
file it is in, and ``[text](#the-band)`` within that file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("sim", "kvtwin", "traces", "reports", "executor", "kernels", "tests", "bench", "scripts",
                  "scenarios", "docs")
SKIPPED_PARTS = {".venv", "node_modules", "__pycache__", "out", "build"}
# A Markdown link to a Markdown file (or to a heading of this one), relative to the file.
MD_LINK = re.compile(r"\]\(((?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+\.md)?#([A-Za-z0-9_-]+)\)")
# A citation outside a link: a path from the repository root, with at least one folder.
CITATION = re.compile(r"(?<!\]\()(?<![\w./-])((?:[A-Za-z0-9_-]+/)+[A-Za-z0-9_-]+\.md)#([A-Za-z0-9_-]+)")


def _slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    """The headings' anchors; a ``#`` line inside a fenced block is a shell or TOML comment."""
    anchors = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def citations(path: Path, text: str) -> list[tuple[Path, str]]:
    """(the file cited, the anchor) for every citation in ``text``, the contents of ``path``."""
    found = [(ROOT / target, anchor) for target, anchor in CITATION.findall(text)]
    if path.suffix == ".md":
        found += [((path.parent / target).resolve() if target else path, anchor)
                  for target, anchor in MD_LINK.findall(text)]
    return found


def broken(cited: list[tuple[Path, str]]) -> list[str]:
    anchors: dict[Path, set[str]] = {}
    missing = []
    for target, anchor in cited:
        if target not in anchors:
            anchors[target] = _anchors(target) if target.is_file() else set()
        if anchor not in anchors[target]:
            missing.append(f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}#{anchor}")
    return missing


def _files() -> list[Path]:
    # Not this file: its examples of broken links are meant to be broken.
    files = sorted(ROOT.glob("*.md"))
    for folder in SOURCE_FOLDERS:
        for pattern in ("*.py", "*.md", "*.toml"):
            files += [p for p in sorted((ROOT / folder).rglob(pattern))
                      if not SKIPPED_PARTS.intersection(p.relative_to(ROOT).parts) and p != Path(__file__).resolve()]
    return files


def test_the_slug_is_the_renderers():
    assert _slug("Retention sliding window") == "retention-sliding-window"
    assert _slug("Hash of one block") == "hash-of-one-block"
    assert _slug("The `CostModel` and its terms (v2)") == "the-costmodel-and-its-terms-v2"


def test_links_resolve_from_where_they_are_written():
    doc = ROOT / "docs" / "capacity.md"
    ok = ("see [the band](#the-band), [capacity](capacity.md#the-band) and `docs/capacity.md#the-band`; "
          "[outputs](architecture.md#outputs)")
    assert broken(citations(doc, ok)) == []
    schema = ROOT / "reports" / "SCHEMA.md"
    assert broken(citations(schema, "[band](../docs/capacity.md#the-band)")) == []
    # The same link from the root names a file that is not there; a wrong anchor misses.
    assert broken(citations(ROOT / "README.md", "[band](../docs/capacity.md#the-band)")) != []
    # Spelled in two pieces, so that no link scanner reads this file as citing it.
    missing = "no-such-" + "heading"
    assert broken(citations(doc, f"[band](capacity.md#{missing})")) == [f"docs/capacity.md#{missing}"]
    nowhere = "no" + "where.md"
    assert broken(citations(ROOT / "sim" / "x.py", f"# docs/{nowhere}#the-band")) == [f"docs/{nowhere}#the-band"]
    assert broken(citations(doc, f"(docs/capacity.md#{missing})")) == [f"docs/capacity.md#{missing}"]


def test_every_cited_anchor_exists():
    cited = []
    for path in _files():
        cited += [(str(path.relative_to(ROOT)), target, anchor) for target, anchor in citations(path, path.read_text())]
    assert sum(1 for where, _, _ in cited if where.endswith(".py")) > 50  # the rules are cited in code
    assert sum(1 for where, _, _ in cited if where.endswith(".md")) > 50  # and between the documents
    missing = [f"{where}: {miss}" for where, target, anchor in cited for miss in broken([(target, anchor)])]
    assert missing == []
