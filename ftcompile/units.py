"""Human-readable sizes for messages and reports."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``11.00 GB``, ``2.7 MB``, ``512 B``: decimal units, precise enough to act on."""
    n = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
