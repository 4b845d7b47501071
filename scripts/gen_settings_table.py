"""Write the README's settings tables from the settings' metadata (kvstore/config/meta.py).

Run after adding or changing a setting, and commit the result::

    python scripts/gen_settings_table.py            # rewrite the tables in README.md
    python scripts/gen_settings_table.py --check    # exit 1 if README.md's tables are stale

Each table sits between two marker comments in README.md and is never edited by hand: a
setting's help text, kind, default and flag live beside its field (``setting(...)`` in the
``kvstore/config/`` modules), where the loader and the ``kvstore serve`` / ``kvstore router``
flags read them too. The first table holds every setting of the loader; the second the vLLM
connector's ``kv_connector_extra_config`` keys (``kvstore/config/connector_keys.py``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The clone's package, whichever kvstore the interpreter has installed.
sys.path.insert(0, str(ROOT))

from kvstore.cli.flags import format_default  # noqa: E402
from kvstore.config import deprecated_names, env_var, setting_fields  # noqa: E402
from kvstore.config.connector_keys import ConnectorKeys  # noqa: E402
from kvstore.config.meta import SettingMeta, meta_of  # noqa: E402
from kvstore.deprecation import REMOVED_IN  # noqa: E402

README = ROOT / "README.md"
BEGIN = "<!-- settings table: written by scripts/gen_settings_table.py, do not edit by hand -->"
END = "<!-- end of settings table -->"
_HEADER = (
    "| Setting | Environment variable | Flag | Default | What it does |",
    "|---|---|---|---|---|",
)
CONNECTOR_BEGIN = (
    "<!-- connector keys: written by scripts/gen_settings_table.py, do not edit by hand -->"
)
CONNECTOR_END = "<!-- end of connector keys -->"
_CONNECTOR_HEADER = ("| Key | Default | What it does |", "|---|---|---|")


def table() -> str:
    """The settings table, markers included: one row per setting, sections in the loader's
    order, then the deprecated names still read."""
    rows = list(_HEADER)
    for name, spec in setting_fields().items():
        meta = meta_of(spec)
        flags = ", ".join(f"`{flag}`" for flag in (meta.flag, *meta.flag_aliases) if flag)
        cells = [f"`{name}`", f"`{env_var(name)}`", flags, _default(meta, spec), _help(meta)]
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    old = deprecated_names()
    renamed = ", ".join(f"`{o}` → `{n}`" for o, n in old.items())
    note = (
        f"\nRenamed in this release, the old names (in the file, as `KVSTORE_*` variables) are "
        f"still read, with a warning naming the new one, until kvstore {REMOVED_IN}: {renamed}."
        if old
        else ""
    )
    return "\n".join([BEGIN, *rows, note, END]) if note else "\n".join([BEGIN, *rows, END])


def connector_table() -> str:
    """The vLLM connector's ``kv_connector_extra_config`` keys, markers included."""
    rows = list(_CONNECTOR_HEADER)
    for spec in fields(ConnectorKeys):
        meta = meta_of(spec)
        cells = [f"`{spec.name}`", _default(meta, spec), _help(meta)]
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join([CONNECTOR_BEGIN, *rows, CONNECTOR_END])


def _default(meta: SettingMeta, spec: Field[Any]) -> str:
    if meta.default_doc or spec.default is MISSING:
        return meta.default_doc
    return f"`{format_default(meta, spec.default)}`"


def _help(meta: SettingMeta) -> str:
    text = meta.help
    if any(f"`{choice}`" not in text for choice in meta.choices):
        text += f" (one of {', '.join(f'`{c}`' for c in meta.choices)})"
    if text.startswith("deprecated"):
        text += f"; removed in kvstore {REMOVED_IN}"
    return text


def _cell(text: str) -> str:
    # A bare | would end the cell; an escaped one stays as it is.
    return text.replace("\\|", "|").replace("|", "\\|")


def render(readme: str) -> str:
    """``readme`` with the text between each pair of markers replaced by its table."""
    for begin, end_marker, text in (
        (BEGIN, END, table()),
        (CONNECTOR_BEGIN, CONNECTOR_END, connector_table()),
    ):
        start, end = readme.find(begin), readme.find(end_marker)
        if start < 0 or end < start:
            raise SystemExit(f"README.md has no table markers ({begin!r} ... {end_marker!r})")
        readme = readme[:start] + text + readme[end + len(end_marker) :]
    return readme


def main() -> int:
    """Rewrite the table, or with ``--check`` say whether README.md's is what it would be."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md's table is stale")
    args = parser.parse_args()
    current = README.read_text("utf-8")
    wanted = render(current)
    if args.check:
        if current != wanted:
            print(
                "README.md's settings table differs from the settings' metadata: run "
                "python scripts/gen_settings_table.py (and commit README.md)"
            )
            return 1
        return 0
    README.write_text(wanted, "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
