"""The docs as a map: a README short enough to read (what kvstore is, the two commands, one
picture, where things are, links), the reference pages it links to under ``docs/``, and no link in
any of them (README.md, BENCHMARKS.md, docs/*.md) that leads nowhere: every file a link names
exists, and every ``#anchor`` is a heading of the page it points into."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
#: The reference pages the README is a map to.
REFERENCE = (
    "architecture",
    "configuration",
    "vllm",
    "cluster-and-router",
    "security-and-tenants",
    "deployment",
    "python-api",
    "operations",
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (code blocks aside)."""
    found, fence = set(), False
    for line in text.splitlines():
        fence = fence != line.startswith("```")
        if not fence and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return found


def test_the_readme_is_a_map() -> None:
    readme = (ROOT / "README.md").read_text("utf-8")
    assert len(readme.splitlines()) < 300
    for page in REFERENCE:
        assert f"](docs/{page}.md" in readme, page
        assert (ROOT / "docs" / f"{page}.md").is_file(), page


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_leads_somewhere(page: Path) -> None:
    text = page.read_text("utf-8")
    broken = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text("utf-8")):
            broken.append(f"{target}: no such heading")
    assert broken == []
