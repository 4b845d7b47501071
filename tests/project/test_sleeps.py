"""No fixed sleep stands in for a condition: tests poll what they wait for, with a deadline.

A test that sleeps a fixed time for something to happen fails on a loaded machine (2 cores at
load 10) when it happens late, and wastes the time on an idle one; ``harness.polling.poll`` (or
``apoll`` on an event loop) waits for the condition itself. So every ``sleep(...)`` call under
``tests/`` (``time.sleep``, ``asyncio.sleep``, any ``x.sleep``) is either inside a loop of its
own function (a poll, a pacing interval, a workload's step) or carries a marker comment saying
why a fixed time is the behaviour under test: ``# sleep: <why>`` on the call's line or on a
comment line right above it. Such a why is one of: time that must pass (a TTL, a window), a
stand-in's simulated work, or a moment at random in a running loop. A negative window (room for
something that must not happen) is not a why: a fixed one can only pass wrongly on a loaded
machine, so such a test waits for an event the code sets (``Prefetcher.idle()``, its counts of
batches in flight and waiting, a later change seen in the index) and then asserts that the
forbidden thing did not happen.

:data:`LEFT_FOLDERS` names the folders not audited yet, each with why.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TypeGuard

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

#: Folders (from the repository root) whose sleeps are not checked yet, and why. None now:
#: tests/vllm_engine, tests/sglang_engine and tests/integrations were audited too (tests/vllm_engine
#: only collected, its changes kept to markers and bounded polls).
LEFT_FOLDERS: dict[str, str] = {}

_MARKER = re.compile(r"#\s*sleep:\s*\S")
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _is_sleep(node: ast.AST) -> TypeGuard[ast.Call]:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "sleep") or (
        isinstance(func, ast.Name) and func.id == "sleep"
    )


def _marked(lines: list[str], lineno: int) -> bool:
    """``# sleep: <why>`` on line ``lineno`` (1-based) or on a comment line right above it."""
    if _MARKER.search(lines[lineno - 1]):
        return True
    above = lines[lineno - 2].strip() if lineno >= 2 else ""
    return above.startswith("#") and bool(_MARKER.match(above))


def bare_sleeps(source: str, name: str) -> list[str]:
    """The sleeps of ``source`` outside a loop of their own function and unmarked, as
    ``"NAME:LINE: CODE"``."""
    lines = source.splitlines()
    found: list[str] = []

    def visit(node: ast.AST, in_loop: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_sleep(child) and not in_loop and not _marked(lines, child.lineno):
                found.append(f"{name}:{child.lineno}: {lines[child.lineno - 1].strip()}")
            if isinstance(child, _SCOPES):
                visit(child, False)  # a loop around a function's definition is not its loop
            else:
                visit(child, in_loop or isinstance(child, _LOOPS))

    visit(ast.parse(source), False)
    return found


def checked_files(tests: Path, left_folders: Iterable[str] = LEFT_FOLDERS) -> list[Path]:
    """The modules under ``tests`` outside ``left_folders`` (:data:`LEFT_FOLDERS`)."""
    root = tests.parent
    left = tuple(left_folders)
    return [
        path
        for path in sorted(tests.rglob("*.py"))
        if not str(path.relative_to(root)).startswith(left)
    ]


def all_bare_sleeps(tests: Path, left_folders: Iterable[str] = LEFT_FOLDERS) -> list[str]:
    """:func:`bare_sleeps` of every checked module, named from the repository root."""
    return [
        line
        for path in checked_files(tests, left_folders)
        for line in bare_sleeps(path.read_text("utf-8"), str(path.relative_to(tests.parent)))
    ]


def test_every_sleep_polls_or_says_why() -> None:
    assert all_bare_sleeps(TESTS) == []


def test_every_folder_left_is_there() -> None:
    assert [left for left in LEFT_FOLDERS if not (ROOT / left).is_dir()] == []


PLANTED = """
import asyncio, time
from time import sleep

def waits() -> None:
    time.sleep(0.3)  # the server is up by now
    sleep(1)
    # sleep: a TTL of 0.1 s runs out
    time.sleep(0.2)
    time.sleep(0.1)  # sleep: the handler's work, as slow as asked
    time.sleep(0.1)  # sleep:
    while not done():
        time.sleep(0.05)
        def later() -> None:
            time.sleep(1)

async def async_waits() -> None:
    await asyncio.sleep(0.01)
    for _ in range(3):
        await asyncio.sleep(0)
    handler = lambda: time.sleep(1)
"""


def test_the_check_catches_a_planted_violation(tmp_path: Path) -> None:
    assert bare_sleeps(PLANTED, "planted.py") == [
        "planted.py:6: time.sleep(0.3)  # the server is up by now",
        "planted.py:7: sleep(1)",
        "planted.py:11: time.sleep(0.1)  # sleep:",
        "planted.py:15: time.sleep(1)",
        "planted.py:18: await asyncio.sleep(0.01)",
        "planted.py:21: handler = lambda: time.sleep(1)",
    ]
    # Through the walk over a tree too, with the folders left out skipped.
    tests = tmp_path / "tests"
    (tests / "store").mkdir(parents=True)
    (tests / "vllm").mkdir()
    (tests / "store" / "test_a.py").write_text("import time\ntime.sleep(1)\n")
    (tests / "vllm" / "test_b.py").write_text("import time\ntime.sleep(1)\n")
    assert all_bare_sleeps(tests, ["tests/vllm/"]) == ["tests/store/test_a.py:2: time.sleep(1)"]
    assert len(all_bare_sleeps(tests)) == 2  # no folder is left out now
