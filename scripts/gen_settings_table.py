"""Write the settings tables of the docs from the settings' metadata (kvstore/config/meta.py).

Run after adding or changing a setting, and commit the result::

    python scripts/gen_settings_table.py            # rewrite the tables
    python scripts/gen_settings_table.py --check    # exit 1 if a table is stale

Each table sits between two marker comments in its page and is never edited by hand: a
setting's help text, kind, default and flag live beside its field (``setting(...)`` in the
``kvstore/config/`` modules), where the loader and the ``kvstore serve`` / ``kvstore router``
flags read them too. ``docs/configuration.md`` holds every setting of the loader;
``docs/vllm.md`` the vLLM connector's ``kv_connector_extra_config`` keys
(``kvstore/config/connector_keys.py``).
"""

from __future__ import annotations

import argparse
import re
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

#: The page of each table.
SETTINGS_PAGE = ROOT / "docs" / "configuration.md"
CONNECTOR_PAGE = ROOT / "docs" / "vllm.md"
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


def _anchors(text: str) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them."""
    found, fence = set(), False
    for line in text.splitlines():
        fence = fence != line.startswith("```")
        if not fence and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return found


def _linked(text: str, page: Path) -> str:
    """``text`` with its links made to work from ``page`` in ``docs/``: a file named from the
    repository root, and each ``(#anchor)`` that ``page`` lacks pointed at the docs page that has
    it (a setting's help names a section, wherever that section lives)."""
    docs = {path: _anchors(path.read_text("utf-8")) for path in sorted(page.parent.glob("*.md"))}

    def point(match: re.Match[str]) -> str:
        anchor = match.group(1)
        if anchor in docs.get(page, set()):
            return match.group(0)
        for path, anchors in docs.items():
            if anchor in anchors:
                return f"]({path.name}#{anchor})"
        return match.group(0)

    def from_docs(match: re.Match[str]) -> str:
        # A help text names files from the repository root, as a setting's docstring does.
        target = match.group(1)
        if target.startswith(("#", "http://", "https://", "../")):
            return match.group(0)
        return f"]({target[len('docs/') :]})" if target.startswith("docs/") else f"](../{target})"

    text = re.sub(r"\]\(([^)\s]+)\)", from_docs, text)
    return re.sub(r"\]\(#([\w-]+)\)", point, text)


def render(page: str, begin: str, end_marker: str, text: str) -> str:
    """``page`` with the text between ``begin`` and ``end_marker`` replaced by ``text``."""
    start, end = page.find(begin), page.find(end_marker)
    if start < 0 or end < start:
        raise SystemExit(f"no table markers ({begin!r} ... {end_marker!r})")
    return page[:start] + text + page[end + len(end_marker) :]


def pages() -> dict[Path, str]:
    """Each page with a table, as it should read."""
    wanted: dict[Path, str] = {}
    for path, begin, end, text in (
        (SETTINGS_PAGE, BEGIN, END, table()),
        (CONNECTOR_PAGE, CONNECTOR_BEGIN, CONNECTOR_END, connector_table()),
    ):
        current = wanted.get(path) or path.read_text("utf-8")
        wanted[path] = render(current, begin, end, _linked(text, path))
    return wanted


def main() -> int:
    """Rewrite the tables, or with ``--check`` say whether the pages' are what they would be."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a table is stale")
    args = parser.parse_args()
    stale = []
    for path, wanted in pages().items():
        if path.read_text("utf-8") == wanted:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(wanted, "utf-8")
    if args.check and stale:
        names = ", ".join(str(p) for p in stale)
        print(
            f"{names}: the settings table differs from the settings' metadata: run "
            f"python scripts/gen_settings_table.py (and commit {names})"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
