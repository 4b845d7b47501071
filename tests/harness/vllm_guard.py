"""The guard of the real-vLLM suite (``tests/vllm_engine``): where vLLM's CPU build is not
installed its test modules are left out, with one line in pytest's header saying so, except under
``KVSTORE_REQUIRE_VLLM=1`` (the test command sets it), where they are collected and a missing
vLLM fails them. The modules themselves carry no guard: ``tests/vllm_engine/conftest.py``
applies this one before any of them is imported."""

from __future__ import annotations

import importlib.util
import os

__all__ = ["vllm_missing"]


def vllm_missing() -> str | None:
    """Why the vLLM suite is left out here, or ``None`` where it runs."""
    if os.environ.get("KVSTORE_REQUIRE_VLLM") == "1":
        return None
    spec = importlib.util.find_spec("vllm")
    # ``tests/vllm_engine`` itself is a namespace package named ``vllm`` where ``tests`` is on the
    # path: only a package with an ``__init__`` (an origin) is vLLM.
    if spec is None or spec.origin is None:
        return "vLLM's CPU build is not installed (KVSTORE_REQUIRE_VLLM=1 makes that a failure)"
    return None
