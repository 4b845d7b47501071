"""Stop a server a test started (``kvstore serve``, redis-server, prometheus): a signal (SIGTERM
unless told), then SIGKILL after a grace period.

Shared by :mod:`serve`, :mod:`redis_server` and :mod:`prometheus_server`; importable as
``stop_process`` from every test module (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

__all__ = ["stop_process"]


def stop_process(process: subprocess.Popen[Any], grace_s: float, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig`` to ``process`` and wait up to ``grace_s`` seconds for it to exit; SIGKILL it
    if it is still there. Returns once it has exited (reaped: no zombie left behind): True if it
    exited on its own (or had already), False if it took the SIGKILL."""
    if process.poll() is not None:
        return True
    process.send_signal(sig)
    try:
        process.wait(timeout=grace_s)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False
