"""The design document's citations resolve: every "docs/DESIGN.md §N" (or §N.M) in the sources, the tests
and the docs names a numbered section of docs/DESIGN.md, and nothing cites a design outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
CITATION = re.compile(r"docs/DESIGN\.md\s+§(\d+(?:\.\d+)?)")
SELF_CITATION = re.compile(r"§(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.MULTILINE)
BARE = re.compile(r"DESIGN(?!\.md)")  # "DESIGN 4.2", "DESIGN section 5": a design outside the repository


def sections() -> set[str]:
    return set(HEADING.findall(DESIGN.read_text(encoding="utf-8")))


def citing_files() -> list[Path]:
    files = [p for d in ("src", "tests") for p in (ROOT / d).rglob("*.py")]
    return files + [ROOT / "README.md", *(p for p in (ROOT / "docs").glob("*.md") if p != DESIGN)]


def test_sections_are_numbered_in_order() -> None:
    top = [s for s in HEADING.findall(DESIGN.read_text(encoding="utf-8")) if "." not in s]
    assert len(top) >= 10 and top == [str(n) for n in range(1, len(top) + 1)]


def test_every_citation_names_a_section_that_exists() -> None:
    known = sections()
    cited = {(p.relative_to(ROOT).as_posix(), s) for p in citing_files()
             for s in CITATION.findall(p.read_text(encoding="utf-8"))}
    assert len({f for f, _ in cited}) >= 5  # the layer modules, the simulator and the benchmarks cite it
    assert [c for c in sorted(cited) if c[1] not in known] == []
    own = set(SELF_CITATION.findall(DESIGN.read_text(encoding="utf-8")))
    assert own - known == set()


def test_nothing_cites_a_design_that_is_not_this_file() -> None:
    stray = [f"{p.relative_to(ROOT).as_posix()}:{n}" for p in citing_files()
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if BARE.search(line) and p.name != "test_docs.py"]
    assert stray == []
    assert "docs/DESIGN.md" in (ROOT / "README.md").read_text(encoding="utf-8")
