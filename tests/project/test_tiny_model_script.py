"""``scripts/tiny-model.sh`` builds the tests' tiny model with the vLLM environment's python.

The environment is a stand-in (``KVSTORE_VLLM_VENV``) whose ``python`` records its arguments and
writes the model directory's marker, so the test checks the wiring without torch; the vLLM tests
build the real model through the same ``tests/vllm_engine/tiny_model.py``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str, venv: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "tiny-model.sh"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "KVSTORE_VLLM_VENV": str(venv)},
        timeout=60,
    )


def test_builds_with_the_recipe_the_tests_use_and_says_how_to_serve_it(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        f'#!/bin/sh\necho "$@" > "{tmp_path / "args"}"\nmkdir -p "$2"\n'
        'touch "$2/kvstore-tiny-llama.json"\n'
    )
    python.chmod(0o755)
    done = _run(tmp_path, "models/tiny", venv=venv)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "args").read_text().split() == [
        str(ROOT / "tests" / "vllm_engine" / "tiny_model.py"),
        "models/tiny",
    ]
    built = tmp_path / "models" / "tiny"
    assert (built / "kvstore-tiny-llama.json").exists()
    assert done.stdout.splitlines()[-1] == (
        f"tiny-model.sh: built {built}; serve it with the README's vLLM command, --model {built}"
    )


def test_without_the_vllm_environment_it_says_which_script_makes_it(tmp_path: Path) -> None:
    done = _run(tmp_path, venv=tmp_path / "missing")
    assert done.returncode == 1
    assert "run bash scripts/setup-vllm.sh first" in done.stderr
