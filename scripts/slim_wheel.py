"""Rewrite a wheel without the files a run never opens, so that it travels in less space.

Used by scripts/gpu-wheels.sh for UCX's wheel (static archives, command-line tools, perf-test
plugins: 40 MB of its 42)::

    python3 scripts/slim_wheel.py WHEEL REGEX    # drop every member whose name matches REGEX

The wheel is rewritten in place, its RECORD without the dropped members (pip installs what the
archive holds); prints the sizes before and after.
"""

from __future__ import annotations

import re
import sys
import tempfile
import zipfile
from pathlib import Path


def slim(wheel: Path, pattern: str) -> tuple[int, int]:
    """Drop the members of ``wheel`` matching ``pattern``; its size before and after."""
    drop = re.compile(pattern)
    before = wheel.stat().st_size
    with tempfile.NamedTemporaryFile(dir=wheel.parent, suffix=".whl", delete=False) as tmp:
        slimmed = Path(tmp.name)
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w") as target:
        for info in source.infolist():
            if drop.search(info.filename):
                continue
            data = source.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [
                    line
                    for line in data.decode().splitlines()
                    if not drop.search(line.split(",", 1)[0])
                ]
                data = ("\n".join(kept) + "\n").encode()
            target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    slimmed.replace(wheel)
    return before, wheel.stat().st_size


def main(argv: list[str]) -> int:
    """``WHEEL REGEX``; 2 on bad arguments."""
    if len(argv) != 2:
        print("usage: slim_wheel.py WHEEL REGEX", file=sys.stderr)
        return 2
    before, after = slim(Path(argv[0]), argv[1])
    print(f"--- {Path(argv[0]).name}: {before >> 20} MiB -> {after >> 20} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
