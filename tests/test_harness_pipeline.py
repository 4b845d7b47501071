"""The connector's worker half round-trips KV bit for bit through a real ``kvstore serve``.

Every cache layout of :mod:`kvstore.integrations.kv_layout`, on the CPU (default suite) and on
CUDA (marked ``gpu``); see tests/gpu_harness.py for how the engines are stood in for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gpu_harness import CASES, Case, round_trip
from serve_process import Serve

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    root = tmp_path_factory.mktemp("harness")
    tmpdir = root / "tmp"
    tmpdir.mkdir()
    flags = ["--listen", "127.0.0.1:0", "--dram-capacity", "64MiB"]
    flags += ["--nvme-path", str(root / "nvme"), "--nvme-capacity", "64MiB"]
    serve = Serve(flags, tmpdir)
    yield serve
    assert serve.stop() == 0, serve.log()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_saved_kv_loads_into_another_engine_bit_for_bit(
    server: Serve, case: Case, device: str, request: pytest.FixtureRequest
) -> None:
    round_trip(case, device, server.target, f"harness-{request.node.name}")


def test_the_harness_runs_alone(tmp_path: Path) -> None:
    """``python tests/gpu_harness.py`` (for the GPU machine, where pytest may be missing)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "tests" / "gpu_harness.py"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("OK ") == len(CASES)
