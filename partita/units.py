"""Numbers as people read them: bytes, counts, FLOPs and seconds (shared by every layer's messages)."""

from __future__ import annotations


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
