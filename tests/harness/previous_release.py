"""The previous release of kvstore (:data:`kvstore.formats.PREVIOUS_RELEASE`), checked out from
this repository's own history as a git worktree, for the tests that run old nodes or servers
beside new ones (start them with ``PYTHONPATH`` set to the checkout and ``PYTHONSAFEPATH=1``, so
that ``python -m kvstore`` does not put this checkout first)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.formats import PREVIOUS_RELEASE

__all__ = ["REPO", "previous_release_checkout"]

#: This repository (whose history holds the previous release).
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def previous_release_checkout(where: Path) -> Iterator[Path]:
    """A worktree of :data:`PREVIOUS_RELEASE` at ``where`` (a path that does not exist yet),
    removed on exit; fails the test, saying why, where git or the history is missing."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("this test needs git and this repository's history")
    made = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), PREVIOUS_RELEASE],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.fail(
            f"cannot check out the previous release {PREVIOUS_RELEASE} (a shallow clone? "
            f"`git fetch --unshallow`): {made.stderr.strip()}"
        )
    try:
        yield where
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)],
            check=False,
            capture_output=True,
        )
