"""Unit formatting shared by the demos, the calculators and the benchmarks (no torch: any part of
k3sys may use it without depending on another design's package)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """Three significant figures in binary units: '429 MiB', '3.38 GiB', '5.45 TiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1000 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:#.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
