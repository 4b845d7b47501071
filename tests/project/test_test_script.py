"""``scripts/test.sh`` runs every suite, says how each went, and fails if any failed.

The runner itself (``scripts/suites.sh``) is driven with stub suites: a failure, an ``exit`` in a
suite function, a skip and a Ctrl-C are each seen in the result lines and the summary, and the
suites after a failing one still run. ``scripts/test.sh`` is run for real in its dry-run mode
(``KVSTORE_TEST_DRY_RUN=1``: no set-up, no suite run), which shows the suites a run has and what
the skip switches say.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from harness.serve import without_settings

ROOT = Path(__file__).resolve().parents[2]
SUITES = ROOT / "scripts" / "suites.sh"
TIMEOUT_S = 60.0


def drive(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in bash after sourcing the runner; its exit status is the summary's."""
    script = tmp_path / "drive.sh"
    script.write_text(f"set -uo pipefail\nsource {SUITES}\n{body}\nsummary\n")
    env = without_settings()
    return subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )


def test_every_suite_runs_after_a_failure_and_the_run_fails(tmp_path: Path) -> None:
    result = drive(
        tmp_path,
        """
stops() { echo "in d"; exit 4; echo "never"; }
suite a true
suite b false
suite c sh -c 'echo to-stderr >&2; exit 3'
suite d stops
skip e "KVSTORE_SKIP_E=1: left out"
suite f echo "f ran"
""",
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    for line in (
        "--- a: ok (",
        "--- b: FAILED (exit 1, ",
        "--- c: FAILED (exit 3, ",
        "--- d: FAILED (exit 4, ",
        "--- e: skipped (KVSTORE_SKIP_E=1: left out)",
        "--- f: ok (",
    ):
        assert line in out, out
    lines = out.splitlines()
    assert "in d" in lines and "never" not in lines and "f ran" in lines
    summary = out.split("=== summary\n", 1)[1].splitlines()
    assert [line.split()[:2] for line in summary[:6]] == [
        ["ok", "a"],
        ["FAILED", "b"],
        ["FAILED", "c"],
        ["FAILED", "d"],
        ["skipped", "e"],
        ["ok", "f"],
    ]
    assert summary[6] == "=== FAILED: 3 of 5 suites (b c d); 1 skipped"


def test_a_clean_run_passes_and_names_its_skips(tmp_path: Path) -> None:
    result = drive(tmp_path, 'suite a true\nskip b "why not"\nsuite c true')
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines()[-1] == "=== passed: 2 suites; 1 skipped"
    assert "  skipped      b                  why not" in result.stdout


def test_ctrl_c_stops_the_run_with_a_summary(tmp_path: Path) -> None:
    script = tmp_path / "drive.sh"
    script.write_text(
        f"set -uo pipefail\nsource {SUITES}\nsuite first true\nsuite long sleep 30\n"
        "suite after true\nsummary\n"
    )
    out = tmp_path / "out"
    with out.open("w") as sink:
        # A session of its own, as a terminal's foreground job: Ctrl-C reaches the whole group.
        proc = subprocess.Popen(["bash", str(script)], stdout=sink, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while "--- long: sleep 30" not in out.read_text():
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT_S) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text()
    assert "--- long: interrupted" in text and "--- after" not in text, text
    assert text.splitlines()[-1] == "=== FAILED: 1 of 2 suites (long); 0 skipped", text


def run_test_sh(**env: str) -> subprocess.CompletedProcess[str]:
    base = without_settings()
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**base, "KVSTORE_TEST_DRY_RUN": "1", **env},
    )


def test_test_sh_has_every_suite() -> None:
    result = run_test_sh()
    assert result.returncode == 0, result.stdout + result.stderr
    names = [
        line.split()[1] for line in result.stdout.split("=== summary\n", 1)[1].splitlines()[:-1]
    ]
    assert names == [
        *("ruff", "ruff-format", "mypy", "generated-code", "pytest", "slow", "vllm", "sglang")
    ]
    assert "--- vllm: would run: bash scripts/setup-vllm.sh && " in result.stdout
    assert "--- sglang: would run: bash scripts/setup-sglang.sh && " in result.stdout
    assert "installing" not in result.stdout  # a dry run sets nothing up


def test_test_sh_says_what_was_skipped_and_why() -> None:
    result = run_test_sh(KVSTORE_SKIP_SLOW="1", KVSTORE_SKIP_VLLM="1", KVSTORE_SKIP_SGLANG="1")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "--- slow: skipped (KVSTORE_SKIP_SLOW=1: " in out
    assert "--- vllm: skipped (KVSTORE_SKIP_VLLM=1: " in out
    assert "--- sglang: skipped (KVSTORE_SKIP_SGLANG=1: " in out
    assert out.splitlines()[-1].endswith("5 suites listed, none run; 3 skipped")


def test_ci_runs_test_sh() -> None:
    assert "exec bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_mypy_checks_what_the_operations_guide_says() -> None:
    # The guide names the type-checked paths; the dry run shows what the suite runs.
    result = run_test_sh()
    assert result.returncode == 0, result.stdout + result.stderr
    scope = "kvstore kernels tests/harness tests/integrations tests/vllm_engine tests/sglang_engine"
    assert f"--- mypy: would run: .venv/bin/mypy {scope}\n" in result.stdout
    guide = " ".join((ROOT / "docs" / "operations.md").read_text().split())
    assert f"mypy (strict, on `{scope}`:" in guide
