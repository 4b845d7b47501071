"""Triton kernels vs the torch reference on CPU tensors, under ``TRITON_INTERPRET=1``.

The cases live in ``harness/interp_cases.py`` and run in one subprocess, so the interpreter setting
never reaches triton in this process (triton reads it when a kernel is defined).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.interp_cases import CASES

#: The tests' folder, where ``python -m harness.interp_cases`` finds the harness.
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    # Installed with the test extra, so a missing triton is a failure, not a skip.
    assert importlib.util.find_spec("triton") is not None, (
        "triton is not installed (it is in the 'test' extra)"
    )
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "harness.interp_cases"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: dict[str, str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_reference_interpreted(interp_results: dict[str, str], case: str) -> None:
    assert interp_results.get(case) == "ok", interp_results.get(case, "case did not run")
