"""BENCHMARKS.md opens with its headline table, and each row of it holds: a ratio, a link to a
section of the page that exists, and a command that runs a script that is there and declares
every flag the command gives it (read from its source: running them needs vLLM or CUDA)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "BENCHMARKS.md").read_text("utf-8")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return "#" + re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


ANCHORS = {_anchor(line[3:]) for line in PAGE.splitlines() if line.startswith("## ")}
HEADLINE = PAGE.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
ROWS = [line for line in HEADLINE.splitlines() if line.startswith("| ") and "](#" in line]
COMMANDS = sorted({c for row in ROWS for c in re.findall(r"`([^`]*benchmarks/\S+\.py[^`]*)`", row)})


def test_the_page_opens_with_the_headline_table() -> None:
    first = next(line for line in PAGE.splitlines() if line.startswith("## "))
    assert first == "## Headline figures"
    assert len(ROWS) >= 8


@pytest.mark.parametrize("row", ROWS, ids=[row.split(" | ")[0][2:40] for row in ROWS])
def test_each_row_has_a_ratio_and_a_section(row: str) -> None:
    cells = [cell.strip() for cell in row.strip("|").split(" | ")]
    assert re.search(r"\*\*\d+(\.\d+)?x?", cells[2]), cells[2]
    link = re.search(r"\]\((#[^)]+)\)", cells[3])
    assert link and link.group(1) in ANCHORS, cells[3]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_runs_a_script_that_takes_its_flags(command: str) -> None:
    words = command.split()
    script = ROOT / next(w for w in words if w.endswith(".py"))
    assert script.is_file(), script
    text = script.read_text("utf-8")
    assert [f for f in words if f.startswith("--") and f'"{f}"' not in text] == []
