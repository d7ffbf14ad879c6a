"""Statistics the harness, the derivations and the gate share. numpy only (no scipy on CI).

- Summary: robust summary of a sample (median, IQR, relative IQR).
- mann_whitney: rank test used by the gate (normal approximation with tie correction).
- wilcoxon_signed_rank: the paired test of the in-run A/B gate (exact without ties, else normal).
- bootstrap_ci: spread of any statistic (constants are reported with it).
- fit_steps: piecewise-constant fit of a curve (cache levels as steps, not eyeballed).
- fit_affine: T = a + V / b (launch overhead a, bandwidth b), with residual spread.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Summary:
    n: int
    min: float
    max: float
    mean: float
    median: float
    q1: float
    q3: float
    stdev: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def rel_iqr(self) -> float:
        """IQR / median: the noise measure the gate compares slowdowns against."""
        return self.iqr / self.median if self.median else float("inf")

    @classmethod
    def of(cls, samples) -> Summary:
        x = np.asarray(samples, dtype=np.float64)
        if x.size == 0:
            raise ValueError("no samples to summarise")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"non-finite samples: {x[~np.isfinite(x)][:5]}")
        q1, med, q3 = np.percentile(x, [25, 50, 75])
        return cls(int(x.size), float(x.min()), float(x.max()), float(x.mean()), float(med), float(q1),
                   float(q3), float(x.std(ddof=1)) if x.size > 1 else 0.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["iqr"] = self.iqr
        d["rel_iqr"] = self.rel_iqr
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Summary:
        return cls(**{k: d[k] for k in ("n", "min", "max", "mean", "median", "q1", "q3", "stdev")})


def _norm_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def mann_whitney(a, b, alternative: str = "greater") -> tuple[float, float]:
    """U statistic of `a` and the p-value that `a` is stochastically greater ('greater'),
    smaller ('less') or different ('two-sided') than `b`. Normal approximation with tie and
    continuity correction; adequate from about 8 samples a side (the gate requires more)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n1, n2 = a.size, b.size
    if n1 == 0 or n2 == 0:
        raise ValueError("mann_whitney needs samples on both sides")
    allv = np.concatenate([a, b])
    order = np.argsort(allv, kind="mergesort")
    ranks = np.empty_like(allv)
    sorted_v = allv[order]
    i = 0
    tie_term = 0.0
    while i < allv.size:
        j = i
        while j + 1 < allv.size and sorted_v[j + 1] == sorted_v[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        t = j - i + 1
        tie_term += t ** 3 - t
        i = j + 1
    u1 = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0
    mu = n1 * n2 / 2.0
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return u1, 1.0
    sd = math.sqrt(var)
    if alternative == "greater":
        p = _norm_sf((u1 - mu - 0.5) / sd)
    elif alternative == "less":
        p = _norm_sf((mu - u1 - 0.5) / sd)
    elif alternative == "two-sided":
        p = min(1.0, 2.0 * _norm_sf((abs(u1 - mu) - 0.5) / sd))
    else:
        raise ValueError(f"unknown alternative {alternative!r}")
    return float(u1), float(p)


def _signed_rank_exact_sf(n: int, w: int) -> float:
    """P(W+ >= w) for n untied, nonzero differences under H0 (every sign equally likely): the
    count of rank subsets summing to >= w over 2^n, by dynamic programming over the sums."""
    top = n * (n + 1) // 2
    counts = np.zeros(top + 1, dtype=np.float64)
    counts[0] = 1.0
    for r in range(1, n + 1):
        counts[r:] = counts[r:] + counts[:-r].copy()
    w = max(0, min(int(w), top + 1))
    return float(counts[w:].sum() / counts.sum())


EXACT_SIGNED_RANK_MAX = 60  # exact distribution up to this many nonzero differences (1830 sums)


def wilcoxon_signed_rank(d, alternative: str = "greater") -> tuple[float, float]:
    """Wilcoxon signed-rank test of paired differences `d` (e.g. log(B/A) per round): W+ (sum
    of the ranks of |d| where d > 0) and the p-value that d is centred above 0 ('greater'),
    below ('less') or away from it ('two-sided'). Zero differences are dropped (Wilcoxon's
    rule). Exact distribution without ties up to EXACT_SIGNED_RANK_MAX differences; otherwise
    the normal approximation with tie and continuity correction. Smallest attainable one-sided
    p is 2^-n: 8 rounds reach 0.0039, 7 rounds 0.0078, 6 rounds only 0.016."""
    x = np.asarray(d, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("wilcoxon_signed_rank: non-finite differences")
    x = x[x != 0.0]
    n = x.size
    if n == 0:
        return 0.0, 1.0
    a = np.abs(x)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(n)
    sa = a[order]
    i, tie_term, tied = 0, 0.0, False
    while i < n:
        j = i
        while j + 1 < n and sa[j + 1] == sa[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        t = j - i + 1
        if t > 1:
            tied = True
            tie_term += t ** 3 - t
        i = j + 1
    w_plus = float(ranks[x > 0].sum())
    top = n * (n + 1) / 2.0
    if not tied and n <= EXACT_SIGNED_RANK_MAX:
        wp = int(round(w_plus))
        p_greater = _signed_rank_exact_sf(n, wp)
        p_less = _signed_rank_exact_sf(n, int(round(top - wp)))  # W- >= its value, by symmetry
    else:
        mu = top / 2.0
        var = n * (n + 1) * (2 * n + 1) / 24.0 - tie_term / 48.0
        sd = math.sqrt(var) if var > 0 else 0.0
        if sd == 0.0:
            return w_plus, 1.0
        p_greater = _norm_sf((w_plus - mu - 0.5) / sd)
        p_less = _norm_sf((mu - w_plus - 0.5) / sd)
    if alternative == "greater":
        p = p_greater
    elif alternative == "less":
        p = p_less
    elif alternative == "two-sided":
        p = min(1.0, 2.0 * min(p_greater, p_less))
    else:
        raise ValueError(f"unknown alternative {alternative!r}")
    return w_plus, float(min(1.0, p))


def student_t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with a whole number of degrees of freedom, from the closed forms
    of P(|T| < t) in theta = atan(t / sqrt(df)) (a finite series in cos^2 theta, odd and even df;
    Abramowitz & Stegun 26.7.3-4). Used for the in-run gate's process-level test, whose df is
    small (2 (replicas - 1))."""
    if df < 1 or int(df) != df:
        raise ValueError(f"student_t_sf: df must be a whole number >= 1, got {df}")
    if math.isnan(t):
        raise ValueError("student_t_sf: t is NaN")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    if t < 0:
        return 1.0 - student_t_sf(-t, df)
    th = math.atan(t / math.sqrt(df))
    c2, s = math.cos(th) ** 2, math.sin(th)
    if df % 2 == 0:  # A = sin th [1 + 1/2 c2 + 1.3/(2.4) c2^2 + ... up to c2^((df-2)/2)]
        term, acc = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            acc += term
        a = s * acc
    else:  # A = 2/pi [th + sin th cos th (1 + 2/3 c2 + 2.4/(3.5) c2^2 + ... up to c2^((df-3)/2))]
        acc = 0.0
        if df > 1:
            term, acc = 1.0, 1.0
            for k in range(1, (df - 1) // 2):
                term *= c2 * (2 * k) / (2 * k + 1)
                acc += term
        a = 2.0 / math.pi * (th + s * math.cos(th) * acc)
    return float(min(1.0, max(0.0, (1.0 - a) / 2.0)))


def student_t_quantile(q: float, df: int) -> float:
    """The t with P(T <= t) = q (bisection on student_t_sf; 0 < q < 1)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"student_t_quantile: q must lie in (0, 1), got {q}")
    if q < 0.5:
        return -student_t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while student_t_sf(hi, df) > 1.0 - q:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if student_t_sf(mid, df) > 1.0 - q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


def bootstrap_ci(samples, stat=np.median, n_boot: int = 1000, ci: float = 0.9, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat` (deterministic for a given seed)."""
    x = np.asarray(samples, dtype=np.float64)
    if x.size < 2:
        v = float(stat(x))
        return v, v
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    vals = np.apply_along_axis(stat, 1, x[idx])
    lo, hi = np.percentile(vals, [(1 - ci) / 2 * 100, (1 + ci) / 2 * 100])
    return float(lo), float(hi)


@dataclass(frozen=True)
class StepFit:
    """A piecewise-constant fit: `levels[i]` holds for x in [edges[i], edges[i+1])."""

    breakpoints: tuple[float, ...]  # x where a new level starts (between two measured points)
    levels: tuple[float, ...]
    bic: float

    def predict(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        idx = np.searchsorted(np.asarray(self.breakpoints), x, side="right")
        return np.asarray(self.levels)[idx]


def fit_steps(x, y, max_levels: int = 5, min_points: int = 2, min_rel_step: float = 0.1) -> StepFit:
    """Least-squares piecewise-constant fit over sorted x, number of levels chosen by BIC.

    Dynamic programming over segment boundaries (exact optimum for each level count). A step
    smaller than `min_rel_step` of the lower level is merged (noise, not a cache level). The
    breakpoint is put at the geometric mean of the two x values it falls between.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    order = np.argsort(x)
    x, y = x[order], y[order]
    n = x.size
    if n < min_points:
        raise ValueError(f"need at least {min_points} points to fit steps, have {n}")
    cs = np.concatenate([[0.0], np.cumsum(y)])
    cs2 = np.concatenate([[0.0], np.cumsum(y * y)])

    def sse(i, j):  # segment y[i:j]
        s = cs[j] - cs[i]
        return (cs2[j] - cs2[i]) - s * s / (j - i)

    max_k = max(1, min(max_levels, n // min_points))
    inf = float("inf")
    best = None
    for k in range(1, max_k + 1):
        cost = np.full((k + 1, n + 1), inf)
        back = np.zeros((k + 1, n + 1), dtype=int)
        cost[0, 0] = 0.0
        for seg in range(1, k + 1):
            for j in range(seg * min_points, n + 1):
                for i in range((seg - 1) * min_points, j - min_points + 1):
                    if cost[seg - 1, i] == inf:
                        continue
                    c = cost[seg - 1, i] + sse(i, j)
                    if c < cost[seg, j]:
                        cost[seg, j] = c
                        back[seg, j] = i
        if cost[k, n] == inf:
            continue
        bounds = [n]
        j = n
        for seg in range(k, 0, -1):
            j = back[seg, j]
            bounds.append(j)
        bounds = bounds[::-1]
        levels = [float(np.mean(y[bounds[s]:bounds[s + 1]])) for s in range(k)]
        ok = all(abs(levels[s + 1] - levels[s]) >= min_rel_step * min(abs(levels[s]), abs(levels[s + 1]))
                 for s in range(k - 1))
        if not ok:
            continue
        rss = max(cost[k, n], 1e-300 * n)
        bic = n * math.log(rss / n) + (2 * k - 1) * math.log(n)
        bps = tuple(float(math.sqrt(x[b - 1] * x[b])) if x[b - 1] > 0 else float((x[b - 1] + x[b]) / 2)
                    for b in bounds[1:-1])
        fit = StepFit(bps, tuple(levels), bic)
        if best is None or fit.bic < best.bic - 1e-9:
            best = fit
    assert best is not None
    return best


@dataclass(frozen=True)
class AffineFit:
    """T = a + V / b: fixed cost a (s) and rate b (units/s), with residual spread."""

    a: float
    b: float
    rel_residual: float  # median |residual| / T

    def predict(self, v) -> np.ndarray:
        return self.a + np.asarray(v, dtype=np.float64) / self.b


def fit_affine(volume, time) -> AffineFit:
    v = np.asarray(volume, dtype=np.float64)
    t = np.asarray(time, dtype=np.float64)
    A = np.stack([np.ones_like(v), v], axis=1)
    w = 1.0 / t  # relative least squares: small and large points count alike
    coef, *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
    a, inv_b = coef
    b = 1.0 / inv_b if inv_b > 0 else float("inf")
    res = np.abs(t - (a + v * inv_b)) / t
    return AffineFit(float(a), float(b), float(np.median(res)))
