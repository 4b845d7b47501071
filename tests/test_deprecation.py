"""The deprecation policy (:mod:`kvstore.deprecation`): every old import path of a moved module
still gives the module, the same object as at its new path, with a warning naming the release
that removes it; type checkers follow the old path through its stub."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from kvstore.deprecation import MOVED_MODULES, REMOVED_IN

PACKAGE = Path(kvstore.__file__).parent


@pytest.mark.parametrize(("old", "new"), MOVED_MODULES.items())
def test_an_old_path_is_the_new_module_with_a_warning(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}.*kvstore {REMOVED_IN}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__ is not None and module.__spec__.name == new  # its own spec kept
    # the file is gone from the old place (a plain rename), a stub for type checkers is there
    short = old.rpartition(".")[2]
    assert not (PACKAGE / f"{short}.py").exists()
    assert f"from {new} import *" in (PACKAGE / f"{short}.pyi").read_text()


def test_every_stub_names_a_moved_module() -> None:
    stubs = {f"kvstore.{p.stem}" for p in PACKAGE.glob("*.pyi")}
    assert stubs == set(MOVED_MODULES)


def test_from_import_of_an_old_path_in_a_fresh_process() -> None:
    """``from kvstore.store_config import DramConfig`` as other code wrote it still runs, and
    the warning points at the line that imported."""
    script = (
        "import warnings\nwarnings.simplefilter('always')\n"
        "from kvstore.store_config import DramConfig\n"
        "from kvstore.config.store import DramConfig as New\nassert DramConfig is New\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=PACKAGE.parent,
    )
    assert done.returncode == 0, done.stderr
    assert "<string>:3: DeprecationWarning: kvstore.store_config moved" in done.stderr
