"""The documentation's relative links resolve: every `[text](path)` and `[text](path#anchor)` in README.md,
data/README.md and docs/*.md names a file inside the repository, and an anchor into a Markdown file names one of
its headings (GitHub's slugs). No doc points outside the repository (`../shared`)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", REPO / "data" / "README.md", *(REPO / "docs").rglob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition in a Markdown file."""
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = CODE_SPAN.sub("", line)  # `[text](path)` in code is not a link
        found += [(number, target) for target in INLINE_LINK.findall(line)]
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            found.append((number, definition.group(1)))
    return found


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = unicodedata.normalize("NFC", text).lower()
    text = "".join(char for char in text if char in " -_" or unicodedata.category(char)[0] in "LNM")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2, ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(doc: Path, root: Path = REPO) -> list[str]:
    """'line N: target (why)' for each relative link of doc that does not resolve inside root."""
    problems = []
    for number, target in links(doc):
        if EXTERNAL.match(target):
            continue
        location, _, anchor = unquote(target).partition("#")
        resolved = (doc.parent / location).resolve() if location else doc
        if not resolved.is_relative_to(root):
            problems.append(f"line {number}: {target} (outside the repository)")
        elif not resolved.exists():
            problems.append(f"line {number}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"line {number}: {target} (no heading #{anchor} in {resolved.name})")
    return problems


def test_the_documents_are_found():
    names = {str(doc.relative_to(REPO)) for doc in DOCS}
    assert {"README.md", "data/README.md", "docs/performance.md", "docs/reliability.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_relative_links_resolve(doc: Path):
    problems = broken_links(doc)
    assert not problems, f"{doc.relative_to(REPO)} has broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_docs_do_not_point_outside_the_repository(doc: Path):
    assert "../shared" not in doc.read_text(encoding="utf-8"), f"{doc.relative_to(REPO)} mentions ../shared"


def test_github_slugs():
    assert github_slug("Quickstart (`make demo`)") == "quickstart-make-demo"
    assert github_slug("The quickstart's recipe") == "the-quickstarts-recipe"
    assert (
        github_slug("Set up and try it (fresh machine, Python ≥ 3.10)")
        == "set-up-and-try-it-fresh-machine-python--310"
    )
    assert github_slug("See [the data](data/README.md): trees") == "see-the-data-trees"


def test_broken_links_and_anchors_are_reported(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Step one\n\n## Step one\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/guide.md) [ok](docs/guide.md#step-one-1) [ok](#top) ![ok](docs/guide.md)\n"
        "# Top\n"
        "[gone](docs/missing.md) [bad anchor](docs/guide.md#step-two) [bad](#nowhere) [out](../shared/x.md)\n"
        "`[code](not/checked.md)` [web](https://example.com/x.md)\n"
        "```\n[fenced](not/checked.md)\n```\n"
        "[ref]: docs/also-missing.md\n"
    )
    assert broken_links(tmp_path / "README.md", root=tmp_path) == [
        "line 3: docs/missing.md (no such file)",
        "line 3: docs/guide.md#step-two (no heading #step-two in guide.md)",
        "line 3: #nowhere (no heading #nowhere in README.md)",
        "line 3: ../shared/x.md (outside the repository)",
        "line 8: docs/also-missing.md (no such file)",
    ]
