"""Write the README's settings table from the settings' metadata (kvstore/config/meta.py).

Run after adding or changing a setting, and commit the result::

    python scripts/gen_settings_table.py            # rewrite the table in README.md
    python scripts/gen_settings_table.py --check    # exit 1 if README.md's table is stale

The table sits between two marker comments in README.md and is never edited by hand: a
setting's help text, kind, default and flag live beside its field (``setting(...)`` in the
``kvstore/*_config.py`` modules), where the loader and the ``kvstore serve`` / ``kvstore router``
flags read them too.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The clone's package, whichever kvstore the interpreter has installed.
sys.path.insert(0, str(ROOT))

from kvstore.cli.flags import format_default  # noqa: E402
from kvstore.config import deprecated_names, env_var, setting_fields  # noqa: E402
from kvstore.config.meta import meta_of  # noqa: E402

README = ROOT / "README.md"
BEGIN = "<!-- settings table: written by scripts/gen_settings_table.py, do not edit by hand -->"
END = "<!-- end of settings table -->"
_HEADER = (
    "| Setting | Environment variable | Flag | Default | What it does |",
    "|---|---|---|---|---|",
)


def table() -> str:
    """The settings table, markers included: one row per setting, sections in the loader's
    order, then the deprecated names still read."""
    rows = list(_HEADER)
    for name, spec in setting_fields().items():
        meta = meta_of(spec)
        if meta.default_doc or spec.default is MISSING:
            default = meta.default_doc
        else:
            default = f"`{format_default(meta, spec.default)}`"
        flags = ", ".join(f"`{flag}`" for flag in (meta.flag, *meta.flag_aliases) if flag)
        help_text = meta.help
        if any(f"`{choice}`" not in help_text for choice in meta.choices):
            help_text += f" (one of {', '.join(f'`{c}`' for c in meta.choices)})"
        cells = [f"`{name}`", f"`{env_var(name)}`", flags, default, help_text]
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    old = deprecated_names()
    renamed = ", ".join(f"`{o}` → `{n}`" for o, n in old.items())
    note = (
        f"\nRenamed in this release, the old names (in the file, as `KVSTORE_*` variables) are "
        f"still read, with a warning naming the new one, until the next: {renamed}."
        if old
        else ""
    )
    return "\n".join([BEGIN, *rows, note, END]) if note else "\n".join([BEGIN, *rows, END])


def _cell(text: str) -> str:
    # A bare | would end the cell; an escaped one stays as it is.
    return text.replace("\\|", "|").replace("|", "\\|")


def render(readme: str) -> str:
    """``readme`` with the text between the markers replaced by :func:`table`."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no settings table markers ({BEGIN!r} ... {END!r})")
    return readme[:start] + table() + readme[end + len(END) :]


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
