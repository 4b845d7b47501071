"""The committed protobuf modules must be exactly what scripts/gen_proto.py generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_protobuf_modules_are_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_modules_say_do_not_edit() -> None:
    generated = ROOT / "kvstore" / "_proto" / "kvstore" / "v1" / "kvstore_pb2.py"
    assert "DO NOT EDIT" in generated.read_text()
