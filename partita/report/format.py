"""Human-readable numbers and plain-text tables."""

from __future__ import annotations

from typing import Sequence


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


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, align: str | None = None) -> str:
    """A plain-text table; ``align`` has one 'l' or 'r' per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
