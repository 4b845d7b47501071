"""The connector's worker half round-trips KV bit for bit through a real ``kvstore serve``.

Every cache layout of :mod:`kvstore.integrations.kv_layout`, on the CPU (default suite) and on
CUDA (marked ``gpu``); see tests/gpu_harness.py for how the engines are stood in for. Each runs
over shared memory (the store on the same host) and, for a worker on another host, over UCX (on
CUDA, received straight into device memory where UCX reaches it): every layout on CUDA, two on
the CPU, where the UCX path does not depend on the layout.

The UCX cases need ``ucxx`` (the ``ucx`` extra): without it this module fails at collection,
unless ``KVSTORE_SKIP_UCX=1`` says that this environment is not meant to have UCX (then only the
shared-memory cases run).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from gpu_harness import CASES, UCX_FLAGS, Case, round_trip
from serve_process import Serve

from kvstore.integrations import vllm_worker
from kvstore.integrations.device_pipeline import Device, Event, LoadPipeline, Stream
from kvstore.protocol.ucx import ucx_unavailable_reason

_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=_GPU)]

_NO_UCX = ucx_unavailable_reason()
if _NO_UCX is not None and os.environ.get("KVSTORE_SKIP_UCX") != "1":
    raise ImportError(
        f"{_NO_UCX}\nInstall the ucx extra (pip install -e '.[ucx]'), or set KVSTORE_SKIP_UCX=1 "
        "where UCX is not expected."
    )
UCX = _NO_UCX is None
#: (device, case) pairs loaded over UCX: every layout on CUDA, two on the CPU.
UCX_RUNS = (
    [
        *[pytest.param("cpu", case, id=f"cpu-{case.id}") for case in CASES[:2]],
        *[pytest.param("cuda", case, id=f"cuda-{case.id}", marks=_GPU) for case in CASES],
    ]
    if UCX
    else []
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    root = tmp_path_factory.mktemp("harness")
    tmpdir = root / "tmp"
    tmpdir.mkdir()
    flags = ["--listen", "127.0.0.1:0", "--dram-capacity", "64MiB"]
    flags += ["--nvme-path", str(root / "nvme"), "--nvme-capacity", "64MiB"]
    serve = Serve([*flags, *UCX_FLAGS] if UCX else flags, tmpdir)
    yield serve
    assert serve.stop() == 0, serve.log()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_saved_kv_loads_into_another_engine_bit_for_bit(
    server: Serve,
    case: Case,
    device: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSTORE_DATA_PLANE", "auto")
    path = round_trip(case, device, server.target, f"harness-{request.node.name}")
    # The store is on this host: shared memory, read in place where the CPU allows it.
    assert path in ("shm-lease", "shm"), path


@pytest.mark.parametrize(("device", "case"), UCX_RUNS)
def test_a_worker_on_another_host_loads_over_ucx(
    server: Serve,
    case: Case,
    device: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSTORE_DATA_PLANE", "ucx")
    path = round_trip(case, device, server.target, f"harness-ucx-{request.node.name}")
    if device == "cpu":
        assert path == "ucx"
    else:
        # Straight into device memory where this process's UCX has a CUDA transport; the
        # page-locked staging otherwise. The harness prints which (see its main()).
        assert path in ("ucx-device", "ucx-pinned"), path


class _CudaStandIn(Device):
    """Claims CUDA for CPU tensors: streams and events that do nothing, host buffers that are
    not page-locked, device buffers full of garbage. A stand-in for the GPU, which cannot run
    here (the ``gpu`` cases above are the real thing): it runs the worker's CUDA-only branches,
    the per-layer staging copy, the device landing and the save's gather, on every CI run."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.is_cuda = True

    def current_stream(self) -> Stream:
        return Stream(None)

    def new_stream(self) -> Stream:
        return Stream(None)

    def new_event(self, *, blocking: bool = False) -> Event:
        return Event(None)

    def host_buffer(
        self, shape: Sequence[int], dtype: torch.dtype, *, zero: bool = True
    ) -> torch.Tensor:
        return (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype)

    def device_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(tuple(shape), 7, dtype=dtype)


#: (data plane, loads received into the device landing): over UCX the first load lands there.
STAND_IN_PLANES = [("auto", 0), *([("ucx", 1)] if UCX else [])]


@pytest.mark.parametrize(("plane", "landed"), STAND_IN_PLANES)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_cuda_branches_round_trip_on_the_cpu_with_stand_in_streams(
    server: Serve,
    case: Case,
    plane: str,
    landed: int,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSTORE_DATA_PLANE", plane)
    monkeypatch.setattr(vllm_worker, "Device", _CudaStandIn)
    landings: list[int] = []
    real_landing = LoadPipeline.device_landing

    def device_landing(pipeline: LoadPipeline, chunks: int) -> torch.Tensor:
        landings.append(chunks)
        return real_landing(pipeline, chunks)

    monkeypatch.setattr(LoadPipeline, "device_landing", device_landing)
    round_trip(case, "cpu", server.target, f"stand-in-{request.node.name}")
    # Engine B's one load: into the landing over UCX (the connector's warm-up settled the path
    # before it), through the staging over shared memory.
    assert len(landings) == landed


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
    assert proc.stdout.count(" via shm") == len(CASES), proc.stdout
