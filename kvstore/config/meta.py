"""What each setting says about itself, written once beside its field.

Every field of a config section (:mod:`kvstore.config`) is declared with :func:`setting`, which
keeps a :class:`SettingMeta` in the field's metadata: its help text, its kind (how a string from the
environment or a flag becomes its value), the values a choice allows, its command-line flag (if any)
and the names it had before. The loader, the ``kvstore serve`` / ``kvstore router`` flags and the
settings table of docs/configuration.md (``scripts/gen_settings_table.py``) are all made from it, so
that they cannot drift apart.

This module is a leaf: the config sections import it, it imports none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any

__all__ = ["KINDS", "SettingMeta", "meta_of", "setting"]

#: How a setting's text becomes its value, beyond what its type says (bool, int, float, str):
#: ``size`` (bytes, with KiB/MiB/GiB/TiB or KB/MB/GB/TB suffixes), ``mode`` (octal permission
#: bits), ``list`` (comma-separated names; a list in TOML; a repeatable flag), ``choice`` (one of
#: :attr:`SettingMeta.choices`).
KINDS = ("", "size", "mode", "list", "choice")


@dataclass(frozen=True)
class SettingMeta:
    """One setting's description.

    ``help``: what it does, as the settings page shows it (Markdown). ``short``: the ``--help`` line
    of its flag where ``help`` is too long for one (else ``help`` without its backticks).
    ``default_doc``: the settings page's default where the value depends on the machine or on
    another setting. ``flag``: its ``kvstore serve`` flag (``kvstore router``'s for ``router.*``),
    ``""`` for none; ``flag_aliases``: older spellings of the flag that keep working. ``old_names``:
    dotted names it had before, read for one release with a warning naming this one.
    """

    help: str
    kind: str = ""
    choices: tuple[str, ...] = ()
    flag: str = ""
    flag_aliases: tuple[str, ...] = ()
    metavar: str = ""
    short: str = ""
    default_doc: str = ""
    old_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A programming error, not a user's: these are written in the source.
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is none of {KINDS}")
        if bool(self.choices) != (self.kind == "choice"):
            raise ValueError("choices go with kind='choice' and only with it")
        for flag in (self.flag, *self.flag_aliases):
            if flag and not flag.startswith("--"):
                raise ValueError(f"flag {flag!r} must start with --")

    @property
    def flag_help(self) -> str:
        """The ``--help`` text of its flag: ``short``, else ``help`` without Markdown quotes."""
        text = self.short or self.help
        return text.replace("`", "").replace("%", "%%")


def setting(
    default: Any = MISSING,
    *,
    help: str,
    kind: str = "",
    choices: tuple[str, ...] = (),
    flag: str = "",
    flag_aliases: tuple[str, ...] = (),
    metavar: str = "",
    short: str = "",
    default_doc: str = "",
    old_names: tuple[str, ...] = (),
    secret: bool = False,
) -> Any:
    """A dataclass field with its :class:`SettingMeta` (``default`` left out: a required field;
    ``secret``: left out of the dataclass's repr)."""
    meta = SettingMeta(
        help=help,
        kind=kind,
        choices=choices,
        flag=flag,
        flag_aliases=flag_aliases,
        metavar=metavar,
        short=short,
        default_doc=default_doc,
        old_names=old_names,
    )
    return dataclasses.field(default=default, repr=not secret, metadata={"setting": meta})


def meta_of(field: dataclasses.Field[Any]) -> SettingMeta:
    """The :class:`SettingMeta` of a config field (one declared without :func:`setting` is a
    programming error: every setting is documented)."""
    meta = field.metadata.get("setting")
    if not isinstance(meta, SettingMeta):
        raise TypeError(f"config field {field.name} is not declared with setting()")
    return meta
