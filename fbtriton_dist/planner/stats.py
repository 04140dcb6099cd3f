"""Id-frequency statistics and skew-aware row cuts.

**Assumption.** Row ids are ranks in frequency order: row 0 is the hottest id, row 1 the next,
and so on (what a vocabulary sorted by count gives). Under ``zipf`` the share of lookups that
hit row ``i`` (0-based) is ``(i + 1) ** -alpha / H(E, alpha)``, with the generalized harmonic
number ``H(n, a) = sum_{k=1..n} k ** -a``. When ids are hashed or otherwise permuted, give a
``histogram`` in row order instead: ``counts[k]`` lookups fall in bucket ``k`` of ``n`` equal
row buckets, spread evenly inside the bucket.

``H(n, a)`` is summed exactly for the first 1024 terms and continued with the Euler-Maclaurin
formula (integral + two correction terms) beyond, so E = 10 billion rows costs O(1).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ._yaml import FieldError, check_choice, check_number

__all__ = ["IdDistribution", "balanced_cuts", "equal_cuts", "generalized_harmonic"]

DistributionKind = Literal["uniform", "zipf", "histogram"]
DISTRIBUTION_KINDS: tuple[str, ...] = DistributionKind.__args__  # type: ignore[attr-defined]
_EXACT_TERMS = 1024


@dataclass(kw_only=True, frozen=True)
class IdDistribution:
    """How lookups spread over a table's rows (see the module docstring for the assumption)."""

    kind: DistributionKind = "uniform"
    """``uniform`` (every row equally likely), ``zipf`` or ``histogram``."""
    alpha: float = 1.0
    """Zipf exponent (``kind == "zipf"``); 1.0-1.2 is typical of ads and item ids."""
    histogram: tuple[float, ...] = ()
    """Lookup counts per equal row bucket, in row order (``kind == "histogram"``)."""

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, DISTRIBUTION_KINDS)
        if self.kind == "zipf":
            check_number("alpha", self.alpha, 0.0, strict=True)
        if self.kind == "histogram":
            if not isinstance(self.histogram, tuple) or not self.histogram:
                raise FieldError("histogram", "expected a non-empty list of bucket counts")
            for i, c in enumerate(self.histogram):
                check_number(f"histogram[{i}]", c, 0.0)
            if sum(self.histogram) <= 0:
                raise FieldError("histogram", "expected at least one count > 0")

    def describe(self) -> str:
        if self.kind == "zipf":
            return f"zipf({self.alpha:g})"
        if self.kind == "histogram":
            return f"histogram({len(self.histogram)} buckets)"
        return "uniform"

    def cdf(self, num_rows: int, row: float) -> float:
        """Share of lookups that hit rows ``[0, row)`` of a table of ``num_rows`` rows."""
        if row <= 0:
            return 0.0
        if row >= num_rows:
            return 1.0
        if self.kind == "zipf":
            return generalized_harmonic(row, self.alpha) / generalized_harmonic(
                num_rows, self.alpha
            )
        if self.kind == "histogram":
            prefix = _prefix_sums(self.histogram)
            x = row * len(self.histogram) / num_rows
            k = int(x)
            return (prefix[k] + self.histogram[k] * (x - k)) / prefix[-1]
        return row / num_rows

    def fraction(self, num_rows: int, row_start: int, row_end: int) -> float:
        """Share of lookups that hit rows ``[row_start, row_end)``."""
        return self.cdf(num_rows, row_end) - self.cdf(num_rows, row_start)

    def inverse_cdf(self, num_rows: int, share: float) -> int:
        """The largest row ``r`` with ``cdf(r) <= share`` (0 <= r <= num_rows)."""
        if share >= 1.0:
            return num_rows
        if self.kind == "uniform":
            r = min(num_rows, max(0, math.floor(share * num_rows)))
            while r < num_rows and self.cdf(num_rows, r + 1) <= share:
                r += 1
            while r > 0 and self.cdf(num_rows, r) > share:
                r -= 1
            return r
        lo, hi = 0, num_rows  # cdf(lo) <= share < cdf(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.cdf(num_rows, mid) <= share:
                lo = mid
            else:
                hi = mid
        return lo


@functools.lru_cache(maxsize=64)
def _prefix_sums(counts: tuple[float, ...]) -> tuple[float, ...]:
    out = [0.0]
    for c in counts:
        out.append(out[-1] + c)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _exact_harmonic(alpha: float) -> tuple[float, ...]:
    return _prefix_sums(tuple(k**-alpha for k in range(1, _EXACT_TERMS + 1)))


def generalized_harmonic(n: float, alpha: float) -> float:
    """``H(n, alpha) = sum_{k=1..n} k ** -alpha`` (exact up to 1024 terms, then Euler-Maclaurin)."""
    exact = _exact_harmonic(alpha)
    if n <= _EXACT_TERMS:
        return exact[int(n)]
    K, a = float(_EXACT_TERMS), alpha
    log_ratio = math.log(n / K)
    if abs(1.0 - a) < 1e-12:
        integral = log_ratio
    else:  # (n^(1-a) - K^(1-a)) / (1-a), written to stay exact as a -> 1
        integral = K ** (1.0 - a) * math.expm1((1.0 - a) * log_ratio) / (1.0 - a)
    f_n, f_K = n**-a, K**-a
    df_n, df_K = -a * n ** (-a - 1.0), -a * K ** (-a - 1.0)
    return exact[-1] + integral + (f_n - f_K) / 2.0 + (df_n - df_K) / 12.0


def equal_cuts(num_rows: int, num_blocks: int) -> list[int]:
    """TorchRec's equal blocks: ``ceil(E / k)`` rows each, the last one shorter (or empty)."""
    block = -(-num_rows // num_blocks)
    return [min(num_rows, i * block) for i in range(num_blocks + 1)]


def balanced_cuts(
    num_rows: int,
    dist: IdDistribution,
    load: Callable[[int, float], float],
    row_caps: Sequence[int],
    rel_tol: float = 1e-4,
) -> list[int] | None:
    """Cut rows ``[0, E)`` into ``k = len(row_caps)`` contiguous blocks, block j to member j.

    ``load(j, share)`` is member j's total cost when it gets ``share`` of the table's lookups
    (non-decreasing in ``share``); block j may hold at most ``row_caps[j]`` rows (memory).
    Minimises the largest load: bisect on the bound ``lam`` and, for a given bound, let each
    member in turn take as many rows as the bound and its cap allow (taking more is never worse
    for the members after it). Returns ``k + 1`` boundaries ``0 = c_0 <= ... <= c_k = E``
    (a member may get an empty block), or None when the caps cannot hold E rows.
    """
    k = len(row_caps)
    if sum(row_caps) < num_rows:
        return None

    def fill(lam: float) -> list[int] | None:
        cuts, start, start_cdf = [0], 0, 0.0
        for j in range(k):
            share = _max_share(load, j, lam)
            if share is None:
                return None
            end = min(num_rows, start + row_caps[j])
            if share < 1.0:
                end = min(end, dist.inverse_cdf(num_rows, start_cdf + share))
            cuts.append(end)
            start, start_cdf = end, dist.cdf(num_rows, end)
        return cuts if start >= num_rows else None

    lo = max(load(j, 0.0) for j in range(k))
    hi = max(load(j, 1.0) for j in range(k))
    best = fill(hi)
    if best is None:  # only the caps could make even the worst bound infeasible
        return None
    while hi - lo > rel_tol * max(hi, 1e-30):
        mid = (lo + hi) / 2.0
        cuts = fill(mid)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    return best


def _max_share(load: Callable[[int, float], float], j: int, lam: float) -> float | None:
    """The largest share s in [0, 1] with load(j, s) <= lam; None if even s = 0 is over."""
    base, full = load(j, 0.0), load(j, 1.0)
    if base > lam:
        return None
    if full <= lam:
        return 1.0
    return (lam - base) / (full - base)  # load is linear in the share (see cost.py)
