"""Stop a server a test started (``kvstore serve``, redis-server, prometheus): a signal (SIGTERM
unless told), then SIGKILL after a grace period.

Shared by :mod:`serve`, :mod:`redis_server` and :mod:`prometheus_server`; importable as
``stop_process`` from every test module (pytest puts ``tests/`` on ``sys.path``).
:func:`stop_group` does the same for an engine started in its own process group (vLLM's and
SGLang's API servers spawn workers that must go with them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any

__all__ = ["stop_group", "stop_process"]


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


def stop_group(process: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM to ``process``'s whole process group (it was started with
    ``start_new_session=True``); returns once the leader is reaped, after up to ``grace_s``, and
    nothing of the group is left: SIGKILL to the group then. The whole group had its SIGTERM
    with the leader, and an engine's leader waits for its workers, so a member still there once
    the leader is gone (or one left from a leader that died earlier) is lingering."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
