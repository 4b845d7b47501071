"""The distribution ships every package of the source tree (the list in pyproject.toml is kept
by hand): a folder left out works in the editable install the tests use and is missing from a
built wheel, where ``kvstore`` then fails to import it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "kvstore").rglob("__init__.py")
    }
    assert found - listed == set(), (
        f"packages missing from pyproject.toml: {sorted(found - listed)}"
    )
    assert "kvstore_kernels" in listed
