"""scripts/gpu-verify.sh and scripts/gpu-wheels.sh, the GPU session's runbook, cannot rot here.

A GPU is lent only to some sessions, for 30 minutes, so the commands that verify the CUDA paths
must work the first time. Here (no CUDA) the verify script is run as its rehearsal
(``KVSTORE_GPU_VERIFY_DEVICE=cpu``): the same steps on the CPU, where every ``gpu`` test skips and
the benchmark runs its tiny rehearsal. Nothing is downloaded: the wheel script is only asked to
refuse bad arguments.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvstore.protocol.ucx import ucx_unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
UCX = ucx_unavailable_reason() is None


def _verify(
    tmp_path: Path, *steps: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    out = tmp_path / "out"
    environ = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(out),
        "KVSTORE_GPU_SITE": str(tmp_path / "site"),
        # Not the checkout's .whl/: wheels fetched there are for the GPU machine's Python.
        "KVSTORE_GPU_WHEELS": str(tmp_path / "no-wheels"),
        # The same on any host: no CUDA device (the rehearsal's gpu tests skip).
        "CUDA_VISIBLE_DEVICES": "",
        # Limits for a busy 2-core CI machine, not the GPU machine's.
        "KVSTORE_GPU_HARNESS_S": "300",
        "KVSTORE_GPU_TESTS_S": "300",
        **env,
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-verify.sh"), *steps],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return done, summary


def test_the_rehearsal_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    done, summary = _verify(tmp_path, KVSTORE_GPU_VERIFY_DEVICE="cpu")
    assert "harness shm: exit 0" in summary, done.stdout + done.stderr
    # Where ucxx imports (CI installs it), the UCX half of the harness runs too.
    if UCX:
        assert "harness ucx: exit 0" in summary, done.stdout + done.stderr
    else:
        assert "ucxx does not import: the UCX cases are not run" in summary
    cases = re.findall(r"^(OK|FAIL) +cpu (\S+) via (\S+)$", summary, re.MULTILINE)
    assert cases and all(verdict == "OK" for verdict, _, _ in cases), summary
    assert {via for _, _, via in cases} == ({"shm-lease", "ucx"} if UCX else {"shm-lease"})
    # Every gpu-marked test is collected and skips here; none fails to import.
    assert "pytest -m gpu: exit 0" in summary, (tmp_path / "out" / "pytest.log").read_text()
    skipped = re.search(r"=+ (\d+) skipped, \d+ deselected in ", summary)
    assert skipped and int(skipped.group(1)) >= 30, summary
    # The benchmark's rehearsal (tiny shapes on the CPU) runs every line of it; its table
    # goes into the summary.
    assert "bench_gpu: exit 0" in summary, (tmp_path / "out" / "bench.log").read_text()
    assert "| tiny | shm-dma |" in summary, summary
    assert "verdict: every step passed" in summary
    assert done.returncode == 0
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "summary.txt",
        "harness.log",
        "pytest.log",
        "bench.log",
        "gpu.json",
        "gpu.md",
    }


def test_without_cuda_it_stops_before_any_step_and_names_the_rehearsal(tmp_path: Path) -> None:
    done, summary = _verify(tmp_path)
    assert done.returncode == 2
    assert "no CUDA device here; KVSTORE_GPU_VERIFY_DEVICE=cpu" in summary
    assert "harness" not in summary


def test_bad_arguments_name_what_is_allowed(tmp_path: Path) -> None:
    done, _ = _verify(tmp_path, "bnech")
    assert done.returncode == 2
    assert "unknown step 'bnech'; allowed: harness, tests, bench" in done.stderr
    done, _ = _verify(tmp_path, KVSTORE_GPU_VERIFY_DEVICE="rocm")
    assert done.returncode == 2
    assert "allowed: cuda (the default), cpu (a rehearsal)" in done.stderr
    for argv, message in (
        (["--cuda"], "unknown argument '--cuda'; allowed: --ucx, --skip NAME"),
        (["--skip"], "--skip needs a package name"),
    ):
        wheels = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu-wheels.sh"), *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wheels.returncode == 2
        assert message in wheels.stderr
