"""Stop a third-party server a test started (redis-server, prometheus): SIGTERM, then SIGKILL.

Shared by :mod:`redis_server` and :mod:`prometheus_server`; importable as ``stop_process`` from
every test module (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import subprocess
from typing import Any

__all__ = ["stop_process"]


def stop_process(process: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM ``process`` and wait up to ``grace_s`` seconds for it to exit; SIGKILL it if it is
    still there. Returns once it has exited (reaped: no zombie left behind)."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
