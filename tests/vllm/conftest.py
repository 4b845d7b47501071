"""Fixtures of the vLLM tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from store_process import StoreProcess


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    """A fresh store per test module, stopped at its end."""
    server = StoreProcess(tmp_path_factory.mktemp("store"))
    yield server
    server.stop()
