"""``scripts/setup-sglang.sh`` says what it is doing, pins every install, fails loudly and installs
nothing that is already there.

The script's environment is a stand-in venv (``KVSTORE_SGLANG_VENV``) whose ``pip`` records each
call, prints what a real install prints (or fails) and lists a given set of installed packages,
and whose ``python`` answers the final import check, so nothing is downloaded.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness.setup_scripts import ROOT, recorded_installs, run_setup, stand_in_venv

REQUIREMENTS = ROOT / "scripts" / "sglang-cpu-requirements.txt"

PIP_OUTPUT = """\
Collecting transformers==5.19.0
  Downloading transformers-5.19.0-py3-none-any.whl (11.2 MB)
Installing collected packages: transformers
Successfully installed transformers-5.19.0
"""


def _pins() -> list[str]:
    return [
        line.strip()
        for line in REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def _venv(tmp_path: Path, pip_exit: int, installed: list[str]) -> Path:
    says = "sglang 0.5.23 torch 2.13.0+cpu kvstore 0.1.0"
    return stand_in_venv(tmp_path, PIP_OUTPUT, says, pip_exit, installed)


def _setup(venv: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return run_setup("setup-sglang.sh", "KVSTORE_SGLANG_VENV", venv, tmp_path, timeout_s=120)


def test_a_fresh_venv_gets_every_step_pinned_with_progress_lines(tmp_path: Path) -> None:
    done = _setup(_venv(tmp_path, 0, installed=[]), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    steps = [line[:10] for line in lines if line.startswith("--- [")]
    assert steps == [f"--- [{i}/6] " for i in range(1, 7)]
    assert any(line.endswith("Collecting transformers==5.19.0") for line in lines), lines
    assert lines[-1].startswith("setup-sglang.sh: ") and "ready in" in lines[-1]
    installs = recorded_installs(tmp_path)
    assert len(installs) == 4, installs
    torch, subset, sglang, kvstore = installs
    assert torch.endswith(" torch==2.13.0")  # first, alone, pinned
    assert "-c " in subset and "-r scripts/sglang-cpu-requirements.txt" in subset
    assert "--no-deps sglang==0.5.23 torchvision==0.28.0" in sglang
    assert "-c " in kvstore and "-e .[test]" in kvstore
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvstore-setup")] == []


def test_every_requirement_is_pinned_exactly_and_no_torch_or_cuda_wheel(tmp_path: Path) -> None:
    pins = _pins()
    assert pins and all("==" in pin and ">" not in pin and "<" not in pin for pin in pins), pins
    names = {pin.split("==")[0].lower() for pin in pins}
    for unwanted in ("torch", "torchvision", "sglang", "sglang-kernel", "flashinfer-python"):
        assert unwanted not in names


def test_an_installed_venv_is_left_as_it_is(tmp_path: Path) -> None:
    installed = [*_pins(), "torch==2.13.0+cpu", "sglang==0.5.23", "torchvision==0.28.0"]
    venv = _venv(tmp_path, 0, installed=installed)
    done = _setup(venv, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    installs = recorded_installs(tmp_path)
    assert len(installs) == 1 and "-e .[test]" in installs[0], installs  # only kvstore itself
    assert "already installed" in done.stdout
    again = _setup(venv, tmp_path)  # pyproject.toml unchanged since: nothing at all
    assert again.returncode == 0, again.stdout + again.stderr
    assert recorded_installs(tmp_path) == installs
    assert "up to date with pyproject.toml" in again.stdout


def test_a_failed_pip_install_fails_the_script_with_pips_last_lines(tmp_path: Path) -> None:
    done = _setup(_venv(tmp_path, 1, installed=[]), tmp_path)
    assert done.returncode == 1
    assert "setup-sglang.sh: FAILED: pip install torch==2.13.0 exited 1" in done.stderr
    assert "ERROR: No matching distribution" in done.stderr
    assert "[3/6]" not in done.stdout
