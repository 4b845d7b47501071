"""How a config section refuses a value: one :class:`~kvstore.errors.ConfigError` line naming the
setting, what it allows and what it got, written the same way by every section.

Each section's ``__post_init__`` calls these for its own rules; :func:`check_choices` checks every
``kind="choice"`` field against the values its :func:`~kvstore.config.meta.setting` declares, so
that a choice's allowed values are written once, beside the field. Comparisons are written so
that NaN fails them (``not value > 0``): ``nan`` from the environment is a number to ``float``.

A leaf beside :mod:`kvstore.config.meta`: the sections import it, it imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from kvstore.config.meta import meta_of
from kvstore.errors import ConfigError

__all__ = [
    "check_choices",
    "require_at_least",
    "require_between",
    "require_choice",
    "require_positive",
    "require_seconds",
]


def _note(why: str) -> str:
    return f" ({why})" if why else ""


def require_positive(name: str, value: float, why: str = "") -> None:
    """Refuse a count, size or duration ``name`` that must be above zero (``why``: a note after
    the rule, e.g. the unit)."""
    if not value > 0:
        raise ConfigError(f"{name} must be > 0{_note(why)}, got {value}")


def require_at_least(name: str, value: float, low: float, why: str = "") -> None:
    """Refuse ``value`` of ``name`` below ``low`` (``why``: what ``low`` means, or what the
    smallest value does, e.g. ``0: off``)."""
    if not value >= low:
        raise ConfigError(f"{name} must be >= {low}{_note(why)}, got {value}")


def require_between(
    name: str,
    value: float,
    low: float,
    high: float,
    why: str = "",
    show: Callable[[Any], str] = str,
) -> None:
    """Refuse ``value`` of ``name`` outside ``low`` to ``high`` (both allowed), the three
    numbers written by ``show``."""
    if not low <= value <= high:
        raise ConfigError(
            f"{name} must be {show(low)} to {show(high)}{_note(why)}, got {show(value)}"
        )


def require_seconds(name: str, value: float) -> None:
    """Refuse a length of time ``name`` that is negative, infinite or NaN (0 allowed)."""
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")


def require_choice(name: str, value: str, choices: Iterable[str]) -> None:
    """Refuse ``value`` of ``name`` unless it is one of ``choices``, listing them."""
    allowed = tuple(choices)
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def check_choices(section: str, config: Any) -> None:
    """Refuse a ``kind="choice"`` field of the dataclass ``config`` (the section ``section``)
    whose value is none of the choices its setting declares."""
    for field in dataclasses.fields(config):
        meta = meta_of(field)
        if meta.kind == "choice":
            require_choice(f"{section}.{field.name}", getattr(config, field.name), meta.choices)
