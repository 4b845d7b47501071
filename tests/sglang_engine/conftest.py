"""The SGLang suite's guard (:mod:`harness.sglang_guard`) and the CPU stand-ins it runs with.

Where SGLang is installed, its CPU stand-ins (:mod:`harness.sglang_cpu`: an import-only
``sgl_kernel``, torchvision's CUDA-only registrations skipped, unpinned host pools) are put in
place here, before any test module imports SGLang. The contract tier's store is a fixture here;
its other parts are :mod:`harness.sglang_contract`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.serve import ServerProcess
from harness.sglang_contract import PAGE_SIZE
from harness.sglang_guard import sglang_installed, sglang_missing

_MISSING = sglang_missing()

if sglang_installed():  # else (under KVSTORE_REQUIRE_SGLANG=1) each test fails on its import
    from harness.sglang_cpu import install

    install()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave the suite's test modules out where SGLang is missing (and not required)."""
    if _MISSING is not None and collection_path.name.startswith("test_"):
        return True
    return None


def pytest_report_header(config: pytest.Config) -> str | None:
    return None if _MISSING is None else f"SGLang suite left out: {_MISSING}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A fresh store (256 MiB of dram, nvme, chunks of :data:`PAGE_SIZE`) per test module."""
    server = ServerProcess(
        tmp_path_factory.mktemp("store"),
        settings={"dram.capacity": "256MiB", "keys.chunk_size": PAGE_SIZE},
        name="store",
    )
    with server:
        yield server
