"""No test module imports another: what several test modules share lives in ``tests/harness/``.

A helper defined in a test module and imported by others ties the modules together (collecting
one runs the other's module code, a rename in one breaks the other), and no one looks for it
there. So every module under ``tests/`` outside ``tests/harness/`` imports nothing of
``tests/`` but ``harness`` (``conftest.py`` modules included: pytest loads them, no one imports
them). An import of a test module is one of:

* a name ``pyproject.toml``'s ``pythonpath`` puts on the path: a file or folder of ``tests/``;
* a module beside the importing file (pytest puts each test file's folder on the path);
* a relative import, or one of ``tests.`` itself.

:data:`LEFT` names the imports not moved yet, each with why; :data:`LEFT_FOLDERS` the folders
whose owners finish the move. Each entry of :data:`LEFT` must still be needed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

#: Top-level names that are packages of their own, not folders of tests/ (the engines).
ENGINES = frozenset({"vllm", "sglang"})

_OWNED = (
    "issue 39 item 6, left for the lead: the helper lives in a test module another issue's "
    "branch is changing ({}); move it into tests/harness/ once that is merged"
)

#: "importing file (from the repository root) -> imported module" -> why it is still there.
LEFT: dict[str, str] = {}

#: Folders whose test modules still import each other, and why.
LEFT_FOLDERS: dict[str, str] = {
    "tests/vllm/": "issue 39 item 6, left for the lead: the real-vLLM suite's fleet, servers and "
    "stand-ins (being changed by issues 36 and 38) move into tests/harness/ with that work",
    "tests/integrations/": "issue 39 item 6, left for the lead: the connector tests share "
    "test_connector_logic's stand-ins (being changed by issue 36): one vLLM stand-in in "
    "tests/harness/ once merged (cuda_stand_in, gpu_harness with it)",
    "tests/sglang/": "issue 39 item 6, left for the lead: the SGLang suite (issue 37) is new",
}


def imports_of_test_modules(tests: Path) -> list[str]:
    """Every import of a module of ``tests/`` (but ``harness``) by a module under ``tests``
    outside ``tests/harness/``, as ``"FILE -> MODULE"`` with FILE from the repository root."""
    top = {p.stem for p in tests.glob("*.py")} | {p.name for p in tests.iterdir() if p.is_dir()}
    top -= {"harness", *ENGINES}
    found = []
    for path in sorted(tests.rglob("*.py")):
        if (tests / "harness") in path.parents:
            continue
        beside = {p.stem for p in path.parent.glob("*.py")} - {path.stem}
        if path.parent == tests:
            beside = set()  # the same names as ``top``
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            for name in names:
                first = name.split(".")[0]
                if name.startswith(".") or first == "tests" or first in top | beside:
                    found.append(f"{path.relative_to(tests.parent)} -> {name}")
    return found


def _left(line: str) -> bool:
    return line in LEFT or any(line.startswith(folder) for folder in LEFT_FOLDERS)


def test_no_test_module_imports_another() -> None:
    assert [line for line in imports_of_test_modules(TESTS) if not _left(line)] == []


def test_every_import_left_is_still_there() -> None:
    found = set(imports_of_test_modules(TESTS))
    assert sorted(set(LEFT) - found) == []


def test_the_check_catches_each_kind(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "harness").mkdir(parents=True)
    (tests / "harness" / "ports.py").write_text("")
    (tests / "shared.py").write_text("")
    (tests / "store").mkdir()
    (tests / "store" / "test_a.py").write_text(
        "from harness.ports import free_port\nimport vllm\nfrom kvstore import KVStoreClient\n"
    )
    (tests / "store" / "test_b.py").write_text(
        "from test_a import helper\nfrom shared import x\nfrom . import c\nimport tests.store\n"
    )
    assert imports_of_test_modules(tests) == [
        "tests/store/test_b.py -> test_a",
        "tests/store/test_b.py -> shared",
        "tests/store/test_b.py -> .",
        "tests/store/test_b.py -> tests.store",
    ]
