"""The flags of ``kvstore serve`` and ``kvstore router``, made from the settings' metadata.

Each setting whose :class:`~kvstore.config.meta.SettingMeta` names a ``flag`` gets it (and its
older spellings, ``flag_aliases``), in a group per config section so that ``--help`` reads by
concern; :func:`flag_overrides` turns what was given into the dotted names
:func:`~kvstore.config.load_config` takes. No flag of a setting is written by hand, so the flags,
the loader and the settings table (``scripts/gen_settings_table.py``) cannot disagree.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstore.config import Config, setting_fields
from kvstore.config.meta import SettingMeta, meta_of
from kvstore.config.sizes import format_size

__all__ = ["add_setting_flags", "flag_overrides", "format_default"]

#: Shown where a flag's metadata names no metavar, by kind.
_METAVARS = {"size": "SIZE", "mode": "MODE", "list": "NAME"}


def add_setting_flags(
    parser: argparse.ArgumentParser, sections: tuple[str, ...], defaults: Config | None
) -> dict[str, str]:
    """Add the flag of every setting of ``sections`` that has one, each section's in a group
    titled ``[section]``; return each flag's ``dest`` and the dotted setting it sets.
    ``defaults`` (this machine's built-in config; ``None`` where it cannot be worked out) gives
    the defaults the help shows."""
    dests: dict[str, str] = {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, spec in setting_fields().items():
        section, field = name.split(".")
        meta = meta_of(spec)
        if section not in sections or not meta.flag:
            continue
        if section not in groups:
            groups[section] = parser.add_argument_group(f"[{section}] settings")
        dest = meta.flag[2:].replace("-", "_")
        value = getattr(getattr(defaults, section), field) if defaults is not None else None
        help_text = meta.flag_help + _default_help(meta, value, defaults is not None)
        options: dict[str, Any] = {"dest": dest, "help": help_text}
        if spec.type in ("bool", bool):
            options.update(action="store_const", const=True, default=None)
        elif meta.kind == "list":
            options.update(action="append", metavar=meta.metavar or _METAVARS["list"])
            options["help"] = (
                meta.flag_help
                + "; repeat the flag for more"
                + options["help"][len(meta.flag_help) :]
            )
        elif meta.kind == "choice":
            options.update(choices=meta.choices)
        else:
            options.update(metavar=meta.metavar or _METAVARS.get(meta.kind, "VALUE"))
        groups[section].add_argument(meta.flag, *meta.flag_aliases, **options)
        dests[dest] = name
    return dests


def flag_overrides(args: argparse.Namespace, dests: dict[str, str]) -> dict[str, Any]:
    """The settings the flags given in ``args`` set, by dotted name (a repeated list flag's
    values joined with commas, as the environment spells a list)."""
    overrides: dict[str, Any] = {}
    for dest, setting in dests.items():
        value = getattr(args, dest)
        if isinstance(value, list):
            value = ",".join(value)
        if value is not None:
            overrides[setting] = value
    return overrides


def format_default(meta: SettingMeta, value: Any) -> str:
    """A setting's default as the settings table and ``--help`` write it: sizes with a binary unit,
    permission bits in octal, ``''`` for an empty string, booleans in TOML's spelling."""
    if meta.kind == "size" and isinstance(value, int):
        return _size(value)
    if meta.kind == "mode" and isinstance(value, int):
        return f"{value:04o}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return "''"
    return str(value)


def _default_help(meta: SettingMeta, value: Any, known: bool) -> str:
    # A flag (a bool) has no default to show; an empty one is "off", which its help says.
    if not known or isinstance(value, bool) or value == "":
        return ""
    text = format_default(meta, value)
    if meta.default_doc and meta.kind == "size":
        # A size worked out from this machine: say how, as a path or an address needs not.
        text += f", {meta.default_doc.replace('`', '')}"
    return f" (default: {text})".replace("%", "%%")


def _size(value: int) -> str:
    if value == 0:
        return "0"  # "off" for most sizes: no unit to read into it
    for unit, name in ((1024**4, "TiB"), (1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if value and value % unit == 0:
            return f"{value // unit}{name}"
    return format_size(value).replace(" ", "")
