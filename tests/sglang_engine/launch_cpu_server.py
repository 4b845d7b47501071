"""``python -m sglang.launch_server`` on this machine's CPU, with the CPU stand-ins in place.

Run it exactly as SGLang's launcher (same flags)::

    python tests/sglang_engine/launch_cpu_server.py --model-path DIR --device cpu ...

The stand-ins (:mod:`harness.sglang_cpu`) are installed at this module's top level, before
SGLang is imported: SGLang starts its scheduler and detokenizer with the ``spawn`` start method,
and a spawned child re-runs this module's top level (as ``__mp_main__``) before it unpickles its
target, so every process of the engine gets them. Test support only, not shipped.
"""

from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
# This file's own folder (tests/sglang_engine) comes first on sys.path when it is run by path; it
# holds no SGLang, but drop it anyway so ``import sglang`` can only find the installed package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

from harness import sglang_cpu  # noqa: E402

sglang_cpu.install()


def main(argv: list[str]) -> None:
    """What ``python -m sglang.launch_server`` does, from this module.

    Not ``runpy.run_module("sglang.launch_server")``: that makes SGLang's launcher the main
    module, and the spawned children would then re-run its top level instead of this one's,
    without the stand-ins.
    """
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
