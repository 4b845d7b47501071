"""Fixtures of the vLLM tests, and their guard (:mod:`harness.vllm_guard`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.serve import ServerProcess
from harness.vllm_guard import vllm_missing

_MISSING = vllm_missing()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave the suite's test modules out where vLLM is missing (and not required)."""
    if _MISSING is not None and collection_path.name.startswith("test_"):
        return True
    return None


def pytest_report_header(config: pytest.Config) -> str | None:
    return None if _MISSING is None else f"vLLM suite left out: {_MISSING}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A fresh store (1 GiB of dram, nvme) per test module, stopped at its end."""
    server = ServerProcess(
        tmp_path_factory.mktemp("store"), settings={"dram.capacity": "1GiB"}, name="store"
    )
    with server:
        yield server
