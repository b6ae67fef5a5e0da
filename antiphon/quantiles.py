"""Quantiles of small samples, shared by the server's dashboard and the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0..1), interpolated between neighbours; None for no values."""
    if not values:
        return None
    return percentile_of_sorted(sorted(values), q)


def percentile_of_sorted(s: Sequence[float], q: float) -> float:
    """`percentile` of values already sorted (at least one), for callers that keep them so."""
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    if pos == lo:  # on a value: that value (an infinite neighbour at weight 0 made it NaN)
        return s[lo]
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
