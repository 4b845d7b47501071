"""The guard of the real-SGLang suite (``tests/sglang_engine``): where SGLang is not installed (the
default environment; ``.venv-sglang`` has it) its test modules are left out, with one line in
pytest's header saying so, except under ``KVSTORE_REQUIRE_SGLANG=1``, where they are collected
and a missing SGLang fails them. The modules carry no guard of their own:
``tests/sglang_engine/conftest.py`` applies this one before any of them is imported."""

from __future__ import annotations

import importlib.util
import os

__all__ = ["sglang_installed", "sglang_missing"]


def sglang_installed() -> bool:
    """Whether SGLang can be imported here."""
    spec = importlib.util.find_spec("sglang")
    # A folder named ``sglang`` anywhere on the path is a namespace package of that name: only a
    # package with an ``__init__`` (an origin) is SGLang.
    return spec is not None and spec.origin is not None


def sglang_missing() -> str | None:
    """Why the SGLang suite is left out here, or ``None`` where it runs."""
    if os.environ.get("KVSTORE_REQUIRE_SGLANG") == "1" or sglang_installed():
        return None
    return "SGLang is not installed (.venv-sglang has it; KVSTORE_REQUIRE_SGLANG=1 fails instead)"
