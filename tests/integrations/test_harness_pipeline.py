"""The connector's worker half round-trips KV bit for bit through a real ``kvstore serve``.

Every cache layout of :mod:`kvstore.integrations.paged.kv_layout`, on the CPU (default suite) and on
CUDA (marked ``gpu``); see harness/gpu_harness.py for how the engines are stood in for. Each runs
over shared memory (the store on the same host) and, for a worker on another host, over UCX (on
CUDA, received straight into device memory where UCX reaches it): every layout on CUDA, two on
the CPU, where the UCX path does not depend on the layout.

The UCX cases need ``ucxx`` (the ``ucx`` extra): without it this module fails at collection,
unless ``KVSTORE_SKIP_UCX=1`` says that this environment is not meant to have UCX (then only the
shared-memory cases run).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import cuda_stand_in
from harness.gpu_harness import CASES, CHUNK, UCX_FLAGS, Case, round_trip
from harness.serve import ServerProcess
from harness.ucx_guard import ucx_expected

from kvstore.client.shm import ShmLease, ShmReservation
from kvstore.integrations.paged import device_pipeline
from kvstore.integrations.paged.device_pipeline import LoadPipeline
from kvstore.integrations.vllm import saves as vllm_saves
from kvstore.integrations.vllm import worker as vllm_worker

_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=_GPU)]

UCX = ucx_expected()
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
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("harness")
    tmpdir = root / "tmp"
    tmpdir.mkdir()
    flags = ["--listen", "127.0.0.1:0", "--dram-capacity", "64MiB"]
    flags += ["--nvme-path", str(root / "nvme"), "--nvme-capacity", "64MiB"]
    serve = ServerProcess(
        root / "serve",
        [*flags, *UCX_FLAGS] if UCX else flags,
        tmpdir=tmpdir,
        settings={"keys.chunk_size": CHUNK},  # the harness's engines take it from the store
    )
    yield serve.start()
    assert serve.stop() == 0, serve.output()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_saved_kv_loads_into_another_engine_bit_for_bit(
    server: ServerProcess,
    case: Case,
    device: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSTORE_DATA_PLANE", "auto")
    path = round_trip(case, device, server.target, f"harness-{request.node.name}")
    # The store is on this host: shared memory, read in place where the CPU allows it; on
    # CUDA, DMAed straight out of the arena.
    assert path in (("shm-lease", "shm") if device == "cpu" else ("shm-dma",)), path


@pytest.mark.parametrize(("device", "case"), UCX_RUNS)
def test_a_worker_on_another_host_loads_over_ucx(
    server: ServerProcess,
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


#: (data plane, loads received into the device landing): over UCX the first load lands there.
STAND_IN_PLANES = [("auto", 0), *([("ucx", 1)] if UCX else [])]


def _logged(method: Any, name: str) -> Any:
    """``method`` noting in the stand-in's log when it ran (beside the DMAs' entries)."""

    def logged(self: Any, *args: Any, **kwargs: Any) -> Any:
        cuda_stand_in.log.append((name, 0, 0))
        return method(self, *args, **kwargs)

    return logged


def _after_every(log: list[tuple[str, int, int]], copy: str, end: str) -> bool:
    """Whether ``copy`` entries ran and every one of them ran before the last ``end`` (the
    transfer's copies all landed before what ended it)."""
    kinds = [kind for kind, _, _ in log]
    if copy not in kinds or end not in kinds:
        return False
    last_end = len(kinds) - 1 - kinds[::-1].index(end)
    return copy not in kinds[last_end:]


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> cuda_stand_in.StandInRegistrar:
    """Workers built from here on see the CUDA stand-in (queued streams, kernels and DMAs; see
    tests/harness/cuda_stand_in.py); returns the registrar their arena registration uses."""
    monkeypatch.setattr(vllm_worker, "Device", cuda_stand_in.StandInDevice)
    cuda_stand_in.log.clear()
    for cls, name in ((ShmLease, "release"), (ShmReservation, "commit")):
        monkeypatch.setattr(cls, name, _logged(getattr(cls, name), name))
    kernels = cuda_stand_in.deferred_kernels()
    monkeypatch.setattr(device_pipeline, "kvstore_kernels", kernels)
    monkeypatch.setattr(vllm_saves, "kvstore_kernels", kernels)
    registrar = cuda_stand_in.StandInRegistrar()
    monkeypatch.setattr(cuda_stand_in.StandInDevice, "registrar", registrar)
    return registrar


@pytest.mark.parametrize(("plane", "landed"), STAND_IN_PLANES)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_the_cuda_branches_round_trip_on_the_cpu_with_stand_in_streams(
    server: ServerProcess,
    case: Case,
    plane: str,
    landed: int,
    stand_in: cuda_stand_in.StandInRegistrar,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA-only branches, on every layout: over shared memory the arena is "page-locked"
    (by the stand-in registrar), the save DMAs into reserved pages and the load DMAs each layer
    out of the leased chunks, every one queued until waited for; over UCX the load lands in
    the device landing."""
    monkeypatch.setenv("KVSTORE_DATA_PLANE", plane)
    landings: list[int] = []
    real_landing = LoadPipeline.device_landing

    def device_landing(pipeline: LoadPipeline, chunks: int) -> torch.Tensor:
        landings.append(chunks)
        return real_landing(pipeline, chunks)

    monkeypatch.setattr(LoadPipeline, "device_landing", device_landing)
    path = round_trip(case, "cpu", server.target, f"stand-in-{request.node.name}")
    # Engine B's one load: into the landing over UCX (the connector's warm-up settled the path
    # before it), DMAed out of the arena over shared memory.
    assert len(landings) == landed
    assert path == ("shm-dma" if plane == "auto" else "host"), path  # CPU tensors: host
    if plane == "auto":
        assert stand_in.registered, "the workers never registered their arena mappings"
        # Engine A's save committed after its device-to-host DMAs had run, engine B's lease
        # ended after its layers' DMAs had run.
        assert _after_every(cuda_stand_in.log, "d2h", "commit"), cuda_stand_in.log[-5:]
        assert _after_every(cuda_stand_in.log, "h2d", "release"), cuda_stand_in.log[-5:]


def test_a_refused_registration_loads_and_saves_through_host_staging(
    server: ServerProcess,
    stand_in: cuda_stand_in.StandInRegistrar,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the driver refuses to page-lock the mapping, the bits still round-trip, through the
    page-locked staging (``shm-staged``): the fallback is a slower path, never a wrong one."""
    monkeypatch.setenv("KVSTORE_DATA_PLANE", "auto")
    stand_in.fail = 2  # cudaErrorMemoryAllocation, say
    path = round_trip(CASES[0], "cpu", server.target, f"refused-{request.node.name}")
    assert path == "shm-staged", path
    assert not stand_in.registered


def test_the_harness_runs_alone(tmp_path: Path) -> None:
    """``python tests/gpu_harness.py`` (for the GPU machine, where pytest may be missing)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
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
