"""Goodness-of-fit statistics for the losslessness tests: Pearson chi-square with its own survival function
(no scipy), and total-variation distance. Used by the acceptor contract and the acceptor tests."""

from __future__ import annotations

import math

import numpy as np


def _lower_gamma_series(a: float, x: float) -> float:
    term = total = 1.0 / a
    ap = a
    for _ in range(10000):
        ap += 1.0
        term *= x / ap
        total += term
        if abs(term) < abs(total) * 1e-16:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_gamma_cf(a: float, x: float) -> float:
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, stat/2)."""
    a, x = df / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    if x < a + 1.0:
        return max(0.0, 1.0 - _lower_gamma_series(a, x))
    return _upper_gamma_cf(a, x)


def chi2_test(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float, int]:
    """Pearson chi-square of observed counts against probabilities (cells with expected < 5 pooled).

    Returns (statistic, degrees of freedom, p-value, observations in cells of probability zero).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    forbidden = int(counts[probs <= 0].sum())
    expected = probs * n
    big = expected >= 5
    obs = list(counts[big])
    exp_ = list(expected[big])
    small = (~big) & (probs > 0)
    if small.any():
        obs.append(counts[small].sum())
        exp_.append(expected[small].sum())
    obs_a, exp_a = np.array(obs), np.array(exp_)
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    df = len(obs_a) - 1
    return stat, df, chi2_sf(stat, df), forbidden


def tv_distance(counts: np.ndarray, probs: np.ndarray) -> float:
    """Total-variation distance between the empirical distribution of `counts` and `probs`."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    return 0.5 * float(np.abs(counts / counts.sum() - np.asarray(probs, dtype=np.float64).ravel()).sum())


def _boundary(holds, start: float, steps: int = 100) -> float:
    """The smallest x >= 0 where `holds(x)`, for a `holds` false below some point and true above it: doubled
    from `start` until it holds, then bisected."""
    lo, hi = 0.0, start
    while not holds(hi):
        lo, hi = hi, hi * 2
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def chi2_critical(df: float, p: float) -> float:
    """The statistic x with P(chi-square(df) >= x) = p."""
    return _boundary(lambda x: chi2_sf(x, df) <= p, max(10.0, 10.0 * df), steps=200)


def chi2_power(df: int, noncentrality: float, p: float, critical: float | None = None) -> float:
    """P(the Pearson test at level p rejects) when the statistic is noncentral chi-square(df, noncentrality),
    by Patnaik's two-moment approximation (a scaled central chi-square; within about 1% here). `critical`: the
    test's critical value, where the caller has it."""
    lam = noncentrality
    scale = (df + 2 * lam) / (df + lam)
    critical = chi2_critical(df, p) if critical is None else critical
    return chi2_sf(critical / scale, (df + lam) ** 2 / (df + 2 * lam))


def detectable_tv(n: int, df: int, p: float, power: float = 0.95) -> float:
    """The total-variation distance between two laws that a Pearson test of n draws over df + 1 cells, at level
    p, detects with probability `power` whatever its shape: the statistic's noncentrality is n times the
    chi-square distance sum (p_i - q_i)^2 / q_i, which is at least (sum |p_i - q_i|)^2 = 4 TV^2 (Cauchy-Schwarz,
    equal where |p_i - q_i| / q_i is the same in every cell), so TV >= sqrt(lambda / 4n) suffices, lambda the
    noncentrality at which the power is reached."""
    critical = chi2_critical(df, p)
    lam = _boundary(lambda lam: chi2_power(df, lam, p, critical) >= power, 1.0)
    return math.sqrt(lam / (4 * n))
