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

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._yaml import FieldError, check_choice, check_number

__all__ = [
    "IdDistribution",
    "balanced_cuts",
    "cdf_array",
    "equal_cuts",
    "generalized_harmonic",
    "inverse_cdf_array",
]

DistributionKind = Literal["uniform", "zipf", "histogram"]
DISTRIBUTION_KINDS: tuple[str, ...] = DistributionKind.__args__  # type: ignore[attr-defined]
_EXACT_TERMS = 1024
SEQUENTIAL_MEMBERS = 32
"""Row cuts over at most this many members are exact bisections with one member at a time
(hot rows land whole under the bound); beyond, one vectorised pass over all members."""


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
            return generalized_harmonic(row, self.alpha) / _harmonic_total(num_rows, self.alpha)
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
        if self.kind == "zipf":  # a bracket around the Newton guess, where it holds
            g = min(num_rows, max(0, math.floor(_zipf_guess_one(self.alpha, num_rows, share))))
            a, b = max(0, g - 2), min(num_rows, g + 3)
            if self.cdf(num_rows, a) <= share:
                lo = a
            if b < num_rows and self.cdf(num_rows, b) > share:
                hi = b
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
    return np.minimum(num_rows, np.arange(num_blocks + 1, dtype=np.int64) * block).tolist()


# -- the same functions over arrays (the planner cuts tables over thousands of ranks) ----------
def harmonic_array(n: np.ndarray, alpha: float) -> np.ndarray:
    """:func:`generalized_harmonic` of every element of ``n`` (the same formula)."""
    n = np.asarray(n, dtype=np.float64)
    exact = _exact_harmonic_array(alpha)
    small = n <= _EXACT_TERMS
    out = exact[np.clip(n, 0, _EXACT_TERMS).astype(np.int64)]
    if not small.all():
        big = np.maximum(n, float(_EXACT_TERMS))
        K, a = float(_EXACT_TERMS), alpha
        log_ratio = np.log(big / K)
        if abs(1.0 - a) < 1e-12:
            integral = log_ratio
        else:
            integral = K ** (1.0 - a) * np.expm1((1.0 - a) * log_ratio) / (1.0 - a)
        f_n, f_K = big**-a, K**-a
        df_n, df_K = -a * big ** (-a - 1.0), -a * K ** (-a - 1.0)
        tail = exact[-1] + integral + (f_n - f_K) / 2.0 + (df_n - df_K) / 12.0
        out = np.where(small, out, tail)
    return out


@functools.lru_cache(maxsize=256)
def _harmonic_total(num_rows: int, alpha: float) -> float:
    return generalized_harmonic(num_rows, alpha)


def _zipf_guess_one(alpha: float, num_rows: int, share: float) -> float:
    """:func:`_zipf_guess` of one share, in plain floats."""
    exact = _exact_harmonic(alpha)
    h = share * _harmonic_total(num_rows, alpha)
    if h <= exact[-1]:
        return float(bisect.bisect_right(exact, h) - 1)
    K, a, x = float(_EXACT_TERMS), alpha, h - exact[-1]
    try:
        if abs(1.0 - a) < 1e-12:
            r = K * math.exp(x)
        else:
            r = K * max(1.0 + (1.0 - a) * x / K ** (1.0 - a), 1e-300) ** (1.0 / (1.0 - a))
    except OverflowError:
        r = float(num_rows)
    r = min(max(r, K), float(num_rows))
    for _ in range(4):
        r = min(max(r - (generalized_harmonic(r, a) - h) * r**a, K), float(num_rows))
    return r


@functools.lru_cache(maxsize=64)
def _exact_harmonic_array(alpha: float) -> np.ndarray:
    out = np.asarray(_exact_harmonic(alpha))
    out.flags.writeable = False
    return out


def _zipf_guess(alpha: float, num_rows: int, shares: np.ndarray) -> np.ndarray:
    """A close real-valued guess of the row where the Zipf cdf reaches ``shares``: the exact
    prefix below 1024 rows, Newton's method on the Euler-Maclaurin form beyond."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return _zipf_newton(alpha, num_rows, shares)


def _zipf_newton(alpha: float, num_rows: int, shares: np.ndarray) -> np.ndarray:
    exact = _exact_harmonic_array(alpha)
    h = shares * _harmonic_total(num_rows, alpha)
    guess = np.searchsorted(exact, h, side="right").astype(np.float64) - 1.0
    far = h > exact[-1]
    if far.any():
        K, a = float(_EXACT_TERMS), alpha
        x = h[far] - exact[-1]
        if abs(1.0 - a) < 1e-12:
            r = K * np.exp(x)
        else:
            r = K * np.power(np.maximum(1.0 + (1.0 - a) * x / K ** (1.0 - a), 1e-300),
                             1.0 / (1.0 - a))
        r = np.clip(r, K, float(num_rows))
        for _ in range(4):
            r = np.clip(r - (harmonic_array(r, a) - h[far]) * r**a, K, float(num_rows))
        guess[far] = r
    return guess


def cdf_array(dist: IdDistribution, num_rows: int, rows: np.ndarray) -> np.ndarray:
    """:meth:`IdDistribution.cdf` of every element of ``rows`` (integer rows)."""
    rows = np.asarray(rows, dtype=np.float64)
    if dist.kind == "zipf":
        out = harmonic_array(np.clip(rows, 0, num_rows), dist.alpha) / _harmonic_total(
            num_rows, dist.alpha)
    elif dist.kind == "histogram":
        prefix = np.asarray(_prefix_sums(dist.histogram))
        counts = np.asarray(dist.histogram)
        x = np.clip(rows, 0, num_rows) * len(counts) / num_rows
        k = np.minimum(x.astype(np.int64), len(counts) - 1)
        out = (prefix[k] + counts[k] * (x - k)) / prefix[-1]
    else:
        out = rows / num_rows
    return np.where(rows <= 0, 0.0, np.where(rows >= num_rows, 1.0, out))


def inverse_cdf_array(dist: IdDistribution, num_rows: int, shares: np.ndarray) -> np.ndarray:
    """:meth:`IdDistribution.inverse_cdf` of every element of ``shares``: the largest row
    ``r`` with ``cdf(r) <= share`` (int64; a bisection over all elements at once)."""
    shares = np.asarray(shares, dtype=np.float64)
    if dist.kind == "uniform":
        guess = shares * num_rows
    elif dist.kind == "zipf":
        guess = _zipf_guess(dist.alpha, num_rows, shares)
    else:
        guess = None
    if guess is None:
        lo = np.zeros(shares.shape, dtype=np.int64)
        hi = np.full(shares.shape, num_rows + 1, dtype=np.int64)
    else:  # a narrow bracket around the guess, widened below where it does not hold
        g = np.clip(np.floor(guess), 0, num_rows).astype(np.int64)
        lo, hi = np.maximum(g - 2, 0), np.minimum(g + 3, num_rows + 1)
        bad_hi = (hi <= num_rows) & (cdf_array(dist, num_rows, hi) <= shares)
        hi = np.where(bad_hi, num_rows + 1, hi)
    # invariant: cdf(lo) <= share (cdf(0) = 0) and cdf(hi) > share (hi = E + 1 stands for
    # "beyond the table")
    ok = cdf_array(dist, num_rows, lo) <= shares
    lo = np.where(ok, lo, 0)
    while True:
        open_ = hi - lo > 1
        if not open_.any():
            break
        mid = (lo + hi) // 2
        below = cdf_array(dist, num_rows, mid) <= shares
        lo = np.where(open_ & below, mid, lo)
        hi = np.where(open_ & ~below, mid, hi)
    return np.minimum(lo, num_rows)


def water_level(base: np.ndarray, slope: np.ndarray, total: float = 1.0) -> float:
    """The least bound ``lam >= max(base)`` with ``sum_j clip((lam - base_j) / slope_j, 0, 1)
    >= total``: the level at which members whose load is ``base_j + slope_j * share`` can take
    ``total`` of a table between them, none above ``lam`` (exact: the sum is piecewise linear
    in ``lam``; its pieces are found by sorting the breakpoints)."""
    a = np.asarray(base, dtype=np.float64)
    b = np.maximum(np.asarray(slope, dtype=np.float64), 1e-300)
    lo = float(a.max())

    def taken(lam: float) -> float:
        return float(np.clip((lam - a) / b, 0.0, 1.0).sum())

    if taken(lo) >= total:
        return lo
    x = np.concatenate([a, a + b])
    d = np.concatenate([1.0 / b, -1.0 / b])
    order = np.argsort(x, kind="stable")
    xs, rate = x[order], np.cumsum(d[order])  # rate: d(sum)/d(lam) just after xs[i]
    f = np.concatenate([[0.0], np.cumsum(rate[:-1] * np.diff(xs))])  # the sum at xs[i]
    i = int(np.searchsorted(f, total, side="left"))
    if i >= len(xs):  # every member full: the table is 'total' > k shares
        return float(xs[-1])
    i = max(i, 1)
    lam = float(xs[i - 1] + (total - f[i - 1]) / rate[i - 1]) if rate[i - 1] > 0 else float(xs[i])
    return max(lo, min(lam, float(xs[i])))


def balanced_cuts(
    num_rows: int,
    dist: IdDistribution,
    base: Sequence[float],
    slope: Sequence[float],
    row_caps: Sequence[int],
    rel_tol: float = 1e-6,
) -> list[int] | None:
    """Cut rows ``[0, E)`` into ``k = len(row_caps)`` contiguous blocks, block j to member j.

    Member j's load is ``base[j] + slope[j] * share`` when its block gets ``share`` of the
    table's lookups (the cost model is linear in the share); block j may hold at most
    ``row_caps[j]`` rows (memory). Minimises the largest load: the bound ``lam`` is the water
    level at which the members' shares sum to the whole table; member j's block ends at the
    row where the cumulative share of members ``0..j`` is reached (so a block is within one
    row's lookups of its share: a hot row too big for one share lands whole on the member
    where the running sum passes it). A block longer than its cap is cut at the cap and the
    members after it start from there; if the caps then leave rows over, ``lam`` is raised
    by bisection. Returns ``k + 1`` boundaries ``0 = c_0 <= ... <= c_k = E`` (a member may get
    an empty block), or None when the caps cannot hold E rows. Vectorised over the members.
    """
    a = np.asarray(base, dtype=np.float64)
    b = np.asarray(slope, dtype=np.float64)
    caps = np.asarray(row_caps, dtype=np.int64)
    if int(caps.sum()) < num_rows:
        return None
    if len(a) <= SEQUENTIAL_MEMBERS:
        return _sequential_cuts(num_rows, dist, a.tolist(), b.tolist(), caps.tolist())
    lam = water_level(a, b)
    cuts = _fill(num_rows, dist, a, b, caps, lam)
    if cuts is not None:
        return cuts
    hi = float((a + np.maximum(b, 0.0)).max())
    best = _fill(num_rows, dist, a, b, caps, hi)
    if best is None:  # only the caps could make even the worst bound infeasible
        return None
    lo = lam
    while hi - lo > rel_tol * max(hi, 1e-30):
        mid = (lo + hi) / 2.0
        cuts = _fill(num_rows, dist, a, b, caps, mid)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    return best


def _sequential_cuts(num_rows: int, dist: IdDistribution, a: list[float], b: list[float],
                     caps: list[int], rel_tol: float = 1e-4) -> list[int] | None:
    """:func:`balanced_cuts` for a few members: bisect on the bound ``lam``; for a bound, each
    member in turn takes as many rows as the bound and its cap allow (taking more is never
    worse for the members after it), so no block's load is above the bound, hot rows
    included."""
    k = len(a)

    def fill(lam: float) -> list[int] | None:
        cuts, start, start_cdf = [0], 0, 0.0
        for j in range(k):
            if a[j] > lam:
                return None
            share = 1.0 if b[j] <= 0 or a[j] + b[j] <= lam else (lam - a[j]) / b[j]
            end = min(num_rows, start + caps[j])
            if share < 1.0:
                end = min(end, dist.inverse_cdf(num_rows, start_cdf + share))
            cuts.append(end)
            start, start_cdf = end, dist.cdf(num_rows, end)
        return cuts if start >= num_rows else None

    lo = max(a)
    hi = max(x + max(y, 0.0) for x, y in zip(a, b, strict=True))
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


def _fill(num_rows: int, dist: IdDistribution, a: np.ndarray, b: np.ndarray, caps: np.ndarray,
          lam: float) -> list[int] | None:
    """Blocks for the bound ``lam`` (see :func:`balanced_cuts`), or None if rows are left."""
    share = np.clip((lam - a) / np.maximum(b, 1e-300), 0.0, 1.0)
    share[b <= 0] = np.where(lam >= a[b <= 0], 1.0, 0.0)
    k, ends, j0, start, start_cdf = len(a), [], 0, 0, 0.0
    while j0 < k:
        target = start_cdf + np.cumsum(share[j0:])
        end = inverse_cdf_array(dist, num_rows, target)
        end[target >= 1.0 - 1e-12] = num_rows  # the sum of the shares reached the whole table
        end = np.maximum.accumulate(np.maximum(end, start))
        prev = np.concatenate([[start], end[:-1]])
        over = end - prev > caps[j0:]
        if not over.any():
            ends.extend(end.tolist())
            break
        i = int(np.argmax(over))
        ends.extend(end[:i].tolist())
        j0 += i
        # member j0 is cut at its cap; so are the members after it whose share, counted from
        # the previous capped end, would still run past their own cap (one run at a time)
        capped = np.minimum(int(prev[i]) + np.cumsum(caps[j0:]), num_rows)
        starts = np.concatenate([[int(prev[i])], capped[:-1]])
        free = inverse_cdf_array(dist, num_rows, cdf_array(dist, num_rows, starts) + share[j0:])
        free = np.maximum(free, starts)
        stop = np.flatnonzero(free <= capped)  # the first member of the run its cap holds
        n = int(stop[0]) if stop.size else len(capped)
        ends.extend(capped[:n].tolist())
        if n < len(capped):
            ends.append(int(free[n]))
            n += 1
        start = ends[-1]
        start_cdf = dist.cdf(num_rows, start)
        j0 += n
    if not ends or ends[-1] < num_rows:
        return None
    return [0, *ends]
