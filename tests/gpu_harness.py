"""Run the connector harness alone, on a machine without pytest (the GPU machine's check)::

    PYTHONPATH=. python tests/gpu_harness.py --device cuda     # every layout; exit 1 on a mismatch
    PYTHONPATH=. python tests/gpu_harness.py --device cuda --data-plane ucx

The harness itself -- a STAND-IN for the vLLM engine around the connector's two real halves --
is :mod:`harness.gpu_harness` (importable here because a script's folder, ``tests/``, is on the
path).
"""

from __future__ import annotations

from harness.gpu_harness import main

if __name__ == "__main__":
    raise SystemExit(main())
