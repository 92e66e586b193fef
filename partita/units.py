"""Numbers as people read them: bytes, counts, FLOPs and seconds (shared by every layer's messages),
and the one parser of a memory size a user writes (``parse_bytes``: ``--memory``, ``--devices 8xh100@40GiB``)."""

from __future__ import annotations

import re

from partita.errors import InputError

# The byte units a memory size may be written in, case as written: B is a byte and b a bit
# ("40Gb" is 40 gigabits, 5 GB), so the B must be a capital; kB is the SI spelling of KB.
BYTE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_ACCEPTED = "B, KB (or kB) / KiB, MB / MiB, GB / GiB, TB / TiB"


def parse_bytes(text: str | None, what: str = "memory") -> int | None:
    """'80GiB' -> 85899345920, '40GB' -> 40000000000 (None -> None). The unit is required and must
    be a byte unit of ``BYTE_UNITS``, written as there: InputError naming ``text`` (``what`` says
    where it was written, e.g. "--memory") for a bare number, bits ("40Gb", "40gbit") or any other unit."""
    if text is None:
        return None
    match = _SIZE.match(text)
    if match is None:
        raise InputError(f"{what} {text!r} is not a size: write a number and a byte unit, e.g. 80GiB, 512MiB or 40GB")
    number, unit = match.groups()
    example = number.rstrip(".") or "1"
    bytes_fix = f"write {example}GiB ({example} x 2^30 bytes) or {example}GB ({example} x 10^9 bytes)"
    if not unit:
        raise InputError(f"{what} {text!r} has no unit: {bytes_fix}; units: {_ACCEPTED}")
    if unit not in BYTE_UNITS:
        raise InputError(f"{what} {text!r}: {_unit_problem(example, unit, bytes_fix)}; byte units: {_ACCEPTED}")
    return int(float(number) * BYTE_UNITS[unit])


def _unit_problem(number: str, unit: str, bytes_fix: str) -> str:
    """Why ``unit`` is not one of BYTE_UNITS, and the byte sizes the user may have meant (never
    guessed into one)."""
    lower = unit.lower()
    bits_suffix = next((s for s in ("bits", "bit") if lower.endswith(s)), "b" if unit.endswith("b") else None)
    if bits_suffix is not None:
        prefix = unit[: len(unit) - len(bits_suffix)]
        as_bytes = prefix.upper().replace("I", "i") + "B"
        why = f"{unit!r} is a unit of bits, not bytes (b is a bit, B a byte)"
        if as_bytes not in BYTE_UNITS:
            return f"{why}: {bytes_fix}"
        eighth = f"{float(number) / 8:g}"  # 40Gb: 5 GB as written, or 40 GB meant
        return f"{why}: {number}{unit} is {eighth}{as_bytes}; write {eighth}{as_bytes}, or {number}{as_bytes} if {number} {as_bytes} was meant"
    spelled = next((u for u in BYTE_UNITS if u.lower() == lower), None)
    if spelled is not None:
        return (
            f"{unit!r} is not spelled as a byte unit (each letter's case matters: b is a bit, m is milli): write "
            f"{number}{spelled} if {number} {spelled} was meant"
        )
    return f"{unit!r} is not a byte unit: {bytes_fix}"


def fmt_bytes(num_bytes: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_count(count: float) -> str:
    """1_557_611_200 -> '1.56 B'."""
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(count) >= threshold:
            return f"{count / threshold:.2f} {suffix}"
    return f"{count:.0f}"


def fmt_flops(flops: float) -> str:
    """14.03e12 -> '14.0 TFLOP'."""
    for threshold, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(flops) >= threshold:
            return f"{flops / threshold:.1f} {prefix}FLOP"
    return f"{flops:.0f} FLOP"


def fmt_seconds(seconds: float) -> str:
    """0.0123 -> '12.3 ms'."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def counted(count: int, singular: str, plural: str | None = None) -> str:
    """``counted(1, "stage")`` -> '1 stage', ``counted(3, "micro-batch", "micro-batches")`` -> '3 micro-batches'."""
    return f"{count} {singular if count == 1 else plural or singular + 's'}"
