"""Every citation of the docs in the source resolves to a heading inside this repository.

The code cites its contracts and formulas as "design section 3" / "docs/design.md section 5" and
"algorithms.md 1.5" / "algorithms.md sections 3.7, 3.9" / "algorithms.md 1.8c". Each cited number
must be a numbered heading of ``docs/design.md`` or ``docs/algorithms.md`` ("## 3. ...",
"### 1.5 ...", "#### 1.8c ..."); a path ``docs/<name>.md`` must exist; nothing may point outside the
repository (``/work/shared``). Relative links between the docs (``[x](page.md#anchor)``) must land on
a page and a heading that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SOURCE_DIRS = ("libs", "services", "tests", "bench", "examples", "scripts")
"""Where citations are looked for; paths ``docs/<name>.md`` are checked in ``libs`` and ``services`` only
(tests hold made-up paths)."""
CITED_DOCS = {"design": "design.md", "algorithms": "algorithms.md"}

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_NUMBER = re.compile(r"^(\d+(?:\.\d+)?[a-z]?)\.?(?:\s|$)")
_CITATION = re.compile(
    r"\b(?:docs/)?(design|algorithms)(?:\.md)?"
    r"((?:\s*(?:,|and|sections?|§)?\s*\d+(?:\.\d+)?[a-z]?\b)+)"
)
_SECTION_NUMBER = re.compile(r"\d+(?:\.\d+)?[a-z]?")
_DOC_PATH = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)\b")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_numbers(markdown: str) -> set[str]:
    """Section numbers of a page's numbered headings: ``## 3. X`` -> 3, ``### 1.8c X`` -> 1.8c."""
    numbers = set()
    for line in _lines_outside_code(markdown):
        heading = _HEADING.match(line)
        if heading:
            number = _NUMBER.match(heading.group(2))
            if number:
                numbers.add(number.group(1))
    return numbers


def citations(text: str) -> list[tuple[str, str]]:
    """``(doc file, section number)`` for every "design section N" / "algorithms.md N.M[, ...]" in ``text``."""
    found = []
    for match in _CITATION.finditer(text):
        doc = CITED_DOCS[match.group(1)]
        for number in _SECTION_NUMBER.findall(match.group(2)):
            found.append((doc, number))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    return {slug(m.group(2)) for line in _lines_outside_code(markdown) if (m := _HEADING.match(line))}


def _lines_outside_code(markdown: str) -> list[str]:
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _source_files() -> list[Path]:
    me = Path(__file__).resolve()
    files = []
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".sh", ".toml") and path.is_file() and path.resolve() != me:
                if ".venv" not in path.parts and "node_modules" not in path.parts:
                    files.append(path)
    return files


def unresolved_references() -> list[str]:
    """Every reference in the source that does not resolve, as ``file:line: reason``."""
    sections = {doc: heading_numbers((DOCS / doc).read_text()) for doc in CITED_DOCS.values() if (DOCS / doc).exists()}
    problems = []
    for path in _source_files():
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "/work/shared" in line:
                problems.append(f"{rel}:{lineno}: points outside the repository: {line.strip()}")
            if "§" in line and not citations(line):
                problems.append(f"{rel}:{lineno}: '§' without 'design' or 'algorithms.md': {line.strip()}")
            for doc, number in citations(line):
                if number not in sections.get(doc, set()):
                    problems.append(f"{rel}:{lineno}: docs/{doc} has no section {number}: {line.strip()}")
            for name in _DOC_PATH.findall(line) if rel.parts[0] in ("libs", "services") else ():
                if not (DOCS / name).exists():
                    problems.append(f"{rel}:{lineno}: docs/{name} does not exist")
    return problems


def test_the_reference_parser_reads_the_forms_the_code_uses() -> None:
    offline = citations("(algorithms.md sections 3.7, 3.9, 3.10)")
    assert offline == [("algorithms.md", "3.7"), ("algorithms.md", "3.9"), ("algorithms.md", "3.10")]
    assert citations("FlashREINFORCE (algorithms.md 1.8d): L = ...") == [("algorithms.md", "1.8d")]
    decoupled = citations("(decoupled form, algorithms.md 4.0 and 4.5)")
    assert decoupled == [("algorithms.md", "4.0"), ("algorithms.md", "4.5")]
    assert citations("consumer loop (design section 3).") == [("design.md", "3")]
    assert citations("see docs/design.md section 5") == [("design.md", "5")]
    assert citations("a design decision, no number") == []
    assert heading_numbers("## 3. Delivery\n### 1.8c Gate\n```\n## 9. in code\n```\n## Notation") == {"3", "1.8c"}


def test_the_source_cites_the_docs_and_the_scan_finds_those_citations() -> None:
    cited = [c for path in _source_files() for c in citations(path.read_text(errors="replace"))]
    assert ("design.md", "3") in cited and ("algorithms.md", "3.1") in cited, "the citation scan finds nothing"
    assert len(cited) >= 20


def test_every_reference_in_the_source_resolves_to_a_heading_in_the_repo_docs() -> None:
    problems = unresolved_references()
    assert not problems, "references that do not resolve:\n" + "\n".join(problems)


def test_a_missing_section_is_reported() -> None:
    numbers = heading_numbers((DOCS / "algorithms.md").read_text())
    assert "1.5" in numbers and "9.9" not in numbers


def test_links_between_the_docs_land_on_a_page_and_a_heading() -> None:
    pages = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
    problems = []
    for page in pages:
        text = page.read_text()
        for target in _LINK.findall("\n".join(_lines_outside_code(text))):
            if "://" in target or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            dest = page if not file_part else (page.parent / file_part)
            if not dest.exists():
                problems.append(f"{page.relative_to(ROOT)}: link to missing {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                problems.append(f"{page.relative_to(ROOT)}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def test_the_readme_docs_index_lists_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [page.name for page in sorted(DOCS.glob("*.md")) if f"](docs/{page.name})" not in readme]
    assert not missing, f"README.md's Documentation table does not list: {missing}"
