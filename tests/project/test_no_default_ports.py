"""No test or benchmark names ``kvstore serve``'s default ports (gRPC 50051, metrics 9464): a
user's own server holds them, and a test that listens there collides with it, one that connects
there talks to it. Servers a test starts listen on free ports (``harness.ports.free_port``, or
``harness.serve.ServerProcess``, which picks them itself).

The files below name a default on purpose, never as an address a test listens on or connects
to (except ``test_demo_script``, which holds 50051 to show the demo keeps off it).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PORT = re.compile(r"(?<![\d.])(50051|9464)(?!\d)")

#: File (from the repository root) → why it may name a default port.
ALLOWED = {
    "tests/test_config.py": "the defaults of the settings, and listen values parsed, not used",
    "tests/cli/test_cli_errors.py": "the help text's defaults, and a URL refused as a target",
    "tests/cli/test_demo_script.py": "holds 50051 itself to show the demo never talks to it",
    "tests/store/test_metrics_counters.py": "the default of server.metrics_listen",
    "tests/project/test_k8s_manifests.py": "the port the Kubernetes manifests declare",
    "tests/node/test_peer_auth.py": "addresses of made-up nodes on 10.0.0.0/8, never dialled",
    "tests/node/test_records_v2.py": "addresses of made-up nodes on 10.0.0.0/8, never dialled",
    "tests/harness/vllm_readme_server.py": "the README's command, whose target the tests replace",
    "tests/harness/sglang_server.py": "docs/sglang.md's command, whose target the tests replace",
    "tests/harness/serve.py": "its docstring: the defaults it keeps away from",
    "tests/test_serve_launcher.py": "a config file naming the defaults, which the launcher drops",
    "tests/project/test_no_default_ports.py": "this test",
}


def _sources() -> list[Path]:
    return sorted(
        path
        for folder in ("tests", "benchmarks", "scripts")
        for pattern in ("*.py", "*.sh")
        for path in (ROOT / folder).rglob(pattern)
    )


def test_no_test_or_benchmark_uses_a_default_port() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _sources()
        if str(path.relative_to(ROOT)) not in ALLOWED
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if DEFAULT_PORT.search(line) and not line.lstrip().startswith("#")  # a comment
    ]
    assert not found, (
        "a default port of kvstore serve, which a user's own server holds; listen on "
        "harness.ports.free_port() or start servers with harness.serve.ServerProcess "
        "(or add the file to ALLOWED with the reason):\n" + "\n".join(found)
    )


def test_the_allowed_files_exist() -> None:
    """An entry outlives its file only by mistake: a file of that name would be allowed."""
    missing = [name for name in ALLOWED if not (ROOT / name).is_file()]
    assert not missing, missing
