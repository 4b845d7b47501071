"""A stand-in virtual environment for the tests of ``scripts/setup-*.sh``, so nothing is downloaded.

Its ``pip`` appends each call's arguments to ``calls`` beside the venv, prints ``pip_output`` on
``install`` (then ``ERROR: No matching distribution`` and exit ``pip_exit`` where that is not 0)
and lists ``installed`` on ``list``; its ``python`` prints ``python_says`` (what the script's
final import check reads). :func:`run_setup` runs a script against it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ROOT", "recorded_installs", "run_setup", "stand_in_venv"]

#: The repository's root (the scripts run from there).
ROOT = Path(__file__).resolve().parents[2]


def stand_in_venv(
    tmp_path: Path,
    pip_output: str,
    python_says: str,
    pip_exit: int = 0,
    installed: Sequence[str] = (),
) -> Path:
    """The root of a venv under ``tmp_path`` whose ``pip`` and ``python`` are shell stand-ins."""
    root = tmp_path / "venv"
    (root / "bin").mkdir(parents=True)
    failure = "ERROR: No matching distribution\n" * bool(pip_exit)
    (tmp_path / "pip.out").write_text(pip_output + failure)
    (tmp_path / "installed").write_text("".join(f"{line}\n" for line in installed))
    pip = root / "bin" / "pip"
    pip.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path / "calls"}"\n'
        f'case "$1" in install) cat "{tmp_path / "pip.out"}"; exit {pip_exit};;\n'
        f'  list) cat "{tmp_path / "installed"}";; esac\n'
        "exit 0\n"
    )
    python = root / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho {python_says}\n")
    for script in (pip, python):
        script.chmod(0o755)
    return root


def run_setup(
    script: str, venv_variable: str, venv: Path, tmp_path: Path, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/<script>`` with ``$venv_variable`` naming ``venv`` and ``$TMPDIR``
    ``tmp_path``; its exit status and output."""
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script)],
        capture_output=True,
        text=True,
        env={**os.environ, venv_variable: str(venv), "TMPDIR": str(tmp_path)},
        timeout=timeout_s,
    )


def recorded_installs(tmp_path: Path) -> list[str]:
    """The ``pip install`` calls the stand-in recorded, in order."""
    calls = (tmp_path / "calls").read_text().splitlines()
    return [call for call in calls if call.startswith("install")]
