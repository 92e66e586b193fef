"""Validation helpers shared by every layer: counts and choices that a user gives.

Each raises ``InputError`` naming the argument, the value and what is accepted, so that the
callers' messages read alike.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

from partita.errors import InputError

E = TypeVar("E", bound=enum.Enum)


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int if it is a whole number >= 1 (not a bool), else InputError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def optional_positive_int(value: Any, name: str) -> int | None:
    """``positive_int`` that lets None through (an option left to the search)."""
    return None if value is None else positive_int(value, name)


def parse_choice(cls: type[E], value: Any, name: str, aliases: Mapping[str, str] | None = None) -> E:
    """The member of the string enum ``cls`` that ``value`` names.

    Case, ``-`` and ``_`` are ignored (``"1F1B"``, ``"interleaved-1f1b"``), in ``aliases`` too, which
    maps other spellings to a member's value. InputError lists the accepted values and aliases.
    """
    if isinstance(value, cls):
        return value
    aliases = aliases or {}

    def key(text: Any) -> str:
        return str(text).lower().replace("-", "").replace("_", "")

    wanted = key({key(a): v for a, v in aliases.items()}.get(key(value), value))
    for member in cls:
        if key(member.value) == wanted:
            return member
    choices = ", ".join(repr(m.value) for m in cls)
    also = f" (or {', '.join(repr(a) for a in aliases)})" if aliases else ""
    raise InputError(f"{name}={value!r} is not one of {choices}{also}")
