"""Robust statistics for the session benchmark: quantiles and paired ratios.

What it is for: figures that survive a noisy machine. A single pass or a
plain mean of warm-turn times is dominated by whatever else the machine did;
the median and the inter-quartile range (p25-p75) are not, and a ratio taken
per paired turn (the same session and turn under two policies, run in
lockstep) cancels the drift both policies saw.

Invariants: pure Python, no torch. Quartiles are the standard library's
`statistics.quantiles(method="inclusive")` (linear interpolation between order
statistics, numpy's default), so the median of an even count is the mean of
the middle two. A ratio whose
denominator is zero or below its metric's floor (`NEAR_ZERO`) is never
computed: the figure is `None` and a reason says which turns had it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

NEAR_ZERO: dict[str, float] = {
    # below these a denominator is noise or "did nothing", and a ratio would be huge
    "ttft_ms": 0.05,
    "drafter_prep_ms": 0.05,
    "acceptance": 0.01,
    "drafter_rows_computed": 0.5,
}


@dataclass(frozen=True)
class Spread:
    """Median and inter-quartile range of some values (`None` each when there were none)."""

    median: float | None
    p25: float | None
    p75: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(None, None, None, 0)
        if len(values) == 1:  # statistics.quantiles needs two points; one point is every quantile
            return cls(values[0], values[0], values[0], 1)
        p25, p50, p75 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(p50, p25, p75, len(values))


@dataclass(frozen=True)
class PairedRatio:
    """Per-pair ratios `a / b` summarised by their median and p25-p75.

    `reason` is set (and every figure `None`) when there were no pairs or some
    denominator was near zero: a median of ratios over "did nothing" turns
    would read as a huge number.
    """

    spread: Spread
    reason: str | None


def paired_ratio(a: Sequence[float], b: Sequence[float], metric: str, b_name: str = "b") -> PairedRatio:
    """The median (p25-p75) of `a[i] / b[i]`; `None` with a reason for ~zero denominators."""
    if len(a) != len(b):
        raise ValueError(f"paired values differ in length: {len(a)} and {len(b)}")
    if not b:
        return PairedRatio(Spread.of([]), "no paired turns")
    floor = NEAR_ZERO.get(metric, 0.0)
    tiny = sum(1 for x in b if abs(x) <= floor)
    if tiny:
        return PairedRatio(
            Spread.of([]),
            f"{b_name} has {metric} at or near zero (<= {floor:g}) on {tiny} of {len(b)} turns",
        )
    return PairedRatio(Spread.of([x / y for x, y in zip(a, b, strict=True)]), None)
