"""The guard of the tests that need ``ucxx`` (the ``ucx`` extra): where it is missing they fail
at collection, loudly, unless ``KVSTORE_SKIP_UCX=1`` says this environment is not meant to have
UCX. A missing dependency must not turn into a quietly skipped suite."""

from __future__ import annotations

import os

import pytest

from kvstore.protocol.ucx import ucx_unavailable_reason

__all__ = ["require_ucx", "ucx_expected"]


def ucx_expected() -> bool:
    """True where UCX works; False where it does not and ``KVSTORE_SKIP_UCX=1`` allows that.

    Raises :class:`ImportError` (failing the calling module's collection) where UCX is missing
    and nothing says that is expected."""
    reason = ucx_unavailable_reason()
    if reason is None:
        return True
    if os.environ.get("KVSTORE_SKIP_UCX") == "1":
        return False
    raise ImportError(
        f"{reason}\nInstall the ucx extra (pip install -e '.[ucx]'), or set KVSTORE_SKIP_UCX=1 "
        "where UCX is not expected."
    )


def require_ucx() -> None:
    """At a test module's top: skip the whole module where ``KVSTORE_SKIP_UCX=1`` and UCX is
    missing; fail its collection where UCX is missing unannounced."""
    if not ucx_expected():
        pytest.skip(f"KVSTORE_SKIP_UCX=1: {ucx_unavailable_reason()}", allow_module_level=True)
