"""Generate the Python protobuf and gRPC modules from ``proto/``.

Run after editing a ``.proto`` file, and commit the result::

    python scripts/gen_proto.py            # regenerate kvstore/_proto/
    python scripts/gen_proto.py --check    # exit 1 if the committed modules are stale

The generated files are never edited by hand. protoc writes absolute imports named after the proto
package (``from kvstore.v1 import ...``); this script rewrites them to the package they live in.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT / "kvstore" / "_proto"
_IMPORT = re.compile(r"^from kvstore\.v1 import", re.MULTILINE)


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every ``.proto`` under ``proto/`` into ``out_root``; return the outputs."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    outputs = sorted(p for p in out_root.rglob("*") if p.suffix in {".py", ".pyi"})
    for path in outputs:
        text = _IMPORT.sub("from kvstore._proto.kvstore.v1 import", path.read_text())
        path.write_text(text)
    for directory in {p.parent for p in outputs} | {out_root}:
        (directory / "__init__.py").touch()
    return outputs


def main() -> int:
    """Regenerate, or with ``--check`` compare a fresh generation with the committed files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if kvstore/_proto is stale")
    args = parser.parse_args()
    if not args.check:
        generate(OUT_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        stale = []
        for path in generate(fresh):
            committed = OUT_ROOT / path.relative_to(fresh)
            if not committed.exists() or committed.read_text() != path.read_text():
                stale.append(str(committed.relative_to(ROOT)))
    if stale:
        print("stale generated files (run python scripts/gen_proto.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
