"""No test module imports another: what several test modules share lives in ``tests/harness/``.

A helper defined in a test module and imported by others ties the modules together (collecting
one runs the other's module code, a rename in one breaks the other), and no one looks for it
there. So every module under ``tests/`` outside ``tests/harness/`` imports nothing of
``tests/`` but ``harness`` (``conftest.py`` modules and the scripts the tests run included).
An import of a test module is one of:

* a name of a file or folder anywhere under ``tests/`` (``pyproject.toml``'s ``pythonpath`` puts
  ``tests/`` on the path, and pytest each collected test file's folder: so a module of one
  folder is importable from any other);
* a relative import, or one of ``tests.`` itself.

The engines' folders (``tests/vllm_engine/``, ``tests/sglang_engine/``) are checked like any
other; the engines' own names are not test modules' (``import vllm`` is vLLM's).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

#: Names of tests/ that are packages of their own, not folders of tests/ (the engines).
ENGINES = frozenset({"vllm", "sglang"})


def importable_names(tests: Path) -> set[str]:
    """What a module under ``tests`` could import of it: each file's and folder's name outside
    ``tests/harness/`` (but the engines'). Pytest puts the folder of every test file it collects
    on the path, so a module of one folder is importable from any other once both are collected
    (``from test_connector_logic import ...`` worked from tests/integration/)."""
    harness = tests / "harness"
    names: set[str] = set()
    for path in tests.rglob("*"):
        if path == harness or harness in path.parents or path.name == "__pycache__":
            continue
        if path.is_dir():
            names.add(path.name)
        elif path.suffix == ".py":
            names.add(path.stem)
    return names - {"harness", "__init__", *ENGINES}


def imports_of_test_modules(tests: Path) -> list[str]:
    """Every import of a module of ``tests/`` (but ``harness``) by a module under ``tests``
    outside ``tests/harness/``, as ``"FILE -> MODULE"`` with FILE from the repository root."""
    names = importable_names(tests)
    found = []
    for path in sorted(tests.rglob("*.py")):
        if (tests / "harness") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                imported = ["." * node.level + (node.module or "")]
            else:
                continue
            for name in imported:
                first = name.split(".")[0]
                if name.startswith(".") or first == "tests" or first in names:
                    found.append(f"{path.relative_to(tests.parent)} -> {name}")
    return found


def test_no_test_module_imports_another() -> None:
    assert imports_of_test_modules(TESTS) == []


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
    (tests / "vllm").mkdir()
    (tests / "vllm" / "fleet.py").write_text("import vllm\nfrom harness.ports import free_port\n")
    (tests / "vllm" / "test_c.py").write_text("from fleet import Fleet\nfrom test_b import y\n")
    assert imports_of_test_modules(tests) == [
        "tests/store/test_b.py -> test_a",
        "tests/store/test_b.py -> shared",
        "tests/store/test_b.py -> .",
        "tests/store/test_b.py -> tests.store",
        "tests/vllm/test_c.py -> fleet",
        "tests/vllm/test_c.py -> test_b",  # another folder's: importable once both are collected
    ]
