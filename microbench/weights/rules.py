"""Derivation rules of the weights class: pure functions of measured samples (numpy only), so
the CPU tests can pin every rule on synthetic curves. Each returns the value, its spread and a
sentence stating the rule; bench.py wraps them into `Derived` records.

Spread is always a bootstrap: every series' samples are resampled (fixed seed), the rule is
re-applied, and the 5-95% range of the outcomes is reported (for integer choices: the range of
the choices made).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..stats import Summary, bootstrap_ci, mann_whitney

N_BOOT = 200
SEED = 0
MIB = 1 << 20
SIGNIFICANCE = 0.01  # Mann-Whitney p-value below which a difference counts
MIN_EFFECT = 0.02  # ... and the median difference must also exceed 2% (and twice the noise)


def _boot_medians(samples: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    return np.array([np.median(rng.choice(s, size=s.size)) for s in samples])


def _pct(vals, lo=5, hi=95) -> tuple[float, float]:
    a, b = np.percentile(np.asarray(vals, dtype=np.float64), [lo, hi])
    return float(a), float(b)


# ------------------------------------------------------------------------------- difference
@dataclass(frozen=True)
class Difference:
    """How much faster `b` is than `a` (a - b of medians, > 0 means b is faster)."""

    delta: float
    ci: tuple[float, float]
    rel: float  # delta / median(a)
    p: float  # Mann-Whitney: a stochastically greater than b
    noise: float  # max rel IQR of the two
    significant: bool


def faster(a, b, min_effect: float = MIN_EFFECT, alpha: float = SIGNIFICANCE) -> Difference:
    """Noise-aware "b is faster than a": Mann-Whitney p < alpha AND the median gain exceeds
    max(min_effect, 2 x the larger relative IQR) of a's median."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    ma, mb = float(np.median(a)), float(np.median(b))
    _, p = mann_whitney(a, b, "greater")
    noise = max(Summary.of(a).rel_iqr, Summary.of(b).rel_iqr)
    rng = np.random.default_rng(SEED)
    boots = [np.median(rng.choice(a, a.size)) - np.median(rng.choice(b, b.size)) for _ in range(N_BOOT)]
    rel = (ma - mb) / ma if ma else 0.0
    sig = bool(p < alpha and rel > max(min_effect, 2.0 * noise))
    return Difference(ma - mb, _pct(boots), rel, p, noise, sig)


# ------------------------------------------------------------------------------- read ceiling
@dataclass(frozen=True)
class Ceiling:
    value: float
    spread: tuple[float, float]
    best: int  # index of the winning configuration
    rule: str


def read_ceiling(work_bytes: Sequence[float], samples_s: Sequence[np.ndarray]) -> Ceiling:
    """Best median bandwidth over configurations; spread = bootstrap interval of that median."""
    if not samples_s:
        raise ValueError("no read configurations measured")
    meds = [w / np.median(s) for w, s in zip(work_bytes, samples_s)]
    i = int(np.argmax(meds))
    lo_t, hi_t = bootstrap_ci(samples_s[i], ci=0.9, seed=SEED)
    return Ceiling(float(meds[i]), (work_bytes[i] / hi_t, work_bytes[i] / lo_t), i,
                   "highest median bytes/s over the swept read configurations (one pass over a buffer >= 8x L2, "
                   "every word summed and checked); spread: 90% bootstrap interval of that configuration's median")


# ------------------------------------------------------------------------------- ring choice
@dataclass(frozen=True)
class RingChoice:
    stages: int
    stage_bytes: int
    best_bandwidth: float
    threshold: float
    chosen_bandwidth: float
    qualifying: tuple[int, ...]  # indices of configs within the threshold
    stages_spread: tuple[float, float]
    bytes_spread: tuple[float, float]
    rule: str


def _cheapest(stages, stage_bytes, meds, his, frac):
    best = max(meds)
    thr = frac * best
    qual = [i for i in range(len(meds)) if meds[i] >= thr or his[i] >= thr]
    i = min(qual, key=lambda j: (stages[j] * stage_bytes[j], stages[j], -meds[j]))
    return i, best, thr, qual


RING_FRAC = 0.97  # the plateau: within 3% of the best ring (configurations past the knee differ by ~1%)
RING_FRAC_SENSITIVITY = 0.01  # the spread also holds the choices at RING_FRAC +- this


def choose_ring(stages: Sequence[int], stage_bytes: Sequence[int], bw_samples: Sequence[np.ndarray],
                frac: float = RING_FRAC) -> RingChoice:
    """Smallest ring (stages x stage_bytes) on the bandwidth plateau: within `frac` of the best.

    The ring is a latency-hiding buffer: bandwidth rises with the bytes in flight until they
    cover the bandwidth-delay product, then stays flat. A threshold on the flat part sits far from
    any configuration; one on the rising part can sit next to one that only one grid measured,
    and then the quick and the full grid choose differently. A configuration qualifies when its median
    bandwidth >= frac x best median, or when it misses by less than its own noise (the upper end of
    its 90% bootstrap interval reaches the line). Among qualifiers the cheaper wins: fewer ring
    bytes, then fewer stages (fewer barrier round trips per byte), then the faster. The spread is
    the range of the choice over bootstrap resamples and over frac +- RING_FRAC_SENSITIVITY, so a
    choice that sits on the threshold says so.
    """
    n = len(stages)
    if n == 0 or not (len(stage_bytes) == len(bw_samples) == n):
        raise ValueError("choose_ring needs one bandwidth sample set per configuration")
    bw = [np.asarray(s, dtype=np.float64) for s in bw_samples]
    meds = [float(np.median(s)) for s in bw]
    his = [bootstrap_ci(s, ci=0.9, seed=SEED)[1] for s in bw]
    i, best, thr, qual = _cheapest(stages, stage_bytes, meds, his, frac)
    picks = [i] + [_cheapest(stages, stage_bytes, meds, his, f)[0]
                   for f in (frac - RING_FRAC_SENSITIVITY, frac + RING_FRAC_SENSITIVITY)]
    rng = np.random.default_rng(SEED)
    for _ in range(N_BOOT):
        m = list(_boot_medians(bw, rng))
        j, *_ = _cheapest(stages, stage_bytes, m, m, frac)
        picks.append(j)
    ps = [stages[j] for j in picks]
    pb = [stage_bytes[j] for j in picks]
    return RingChoice(int(stages[i]), int(stage_bytes[i]), best, thr, meds[i], tuple(qual),
                      (float(min(ps)), float(max(ps))), (float(min(pb)), float(max(pb))),
                      f"smallest ring (stages x stage_bytes) on the bandwidth plateau: median bandwidth >= {frac:.0%} "
                      "of the best configuration's (or missing it by less than its 90% bootstrap interval); ties go "
                      "to fewer ring bytes, then fewer stages; spread: range of the choice over "
                      f"{N_BOOT} bootstrap resamples of every configuration and over a threshold of "
                      f"{frac - RING_FRAC_SENSITIVITY:.0%}-{frac + RING_FRAC_SENSITIVITY:.0%}")


# ------------------------------------------------------------------------------- copy size
@dataclass(frozen=True)
class CopyChoice:
    value: int  # smallest bulk-copy size that keeps the stream at >= frac of one copy per stage
    spread: tuple[float, float]
    base: float  # median bandwidth with one copy per stage
    threshold: float
    rule: str


def _min_copy(piece_bytes, meds, frac):
    order = sorted(range(len(piece_bytes)), key=lambda i: -piece_bytes[i])  # one copy per stage first
    thr = frac * meds[order[0]]
    ok = piece_bytes[order[0]]
    for i in order:  # shrink while every size down to this one still qualifies
        if meds[i] < thr:
            break
        ok = piece_bytes[i]
    return int(ok), meds[order[0]], thr


def min_copy_bytes(piece_bytes: Sequence[int], bw_samples: Sequence[np.ndarray], frac: float = 0.95) -> CopyChoice:
    """The smallest bulk-copy size such that a stage delivered in copies of that size (and of
    every larger tested size) streams at >= frac of the bandwidth of one copy per stage."""
    if len(piece_bytes) == 0 or len(piece_bytes) != len(bw_samples):
        raise ValueError("min_copy_bytes needs one bandwidth sample set per copy size")
    bw = [np.asarray(s, dtype=np.float64) for s in bw_samples]
    v, base, thr = _min_copy(list(piece_bytes), [float(np.median(s)) for s in bw], frac)
    rng = np.random.default_rng(SEED)
    boots = [_min_copy(list(piece_bytes), list(_boot_medians(bw, rng)), frac)[0] for _ in range(N_BOOT)]
    return CopyChoice(v, (float(min(boots)), float(max(boots))), base, thr,
                      f"smallest bulk-copy size whose stream (and every larger size's) keeps >= {frac:.0%} of the "
                      "median bandwidth of one copy per stage; spread: range over "
                      f"{N_BOOT} bootstrap resamples")


# ------------------------------------------------------------------------------- L2 capacity
@dataclass(frozen=True)
class L2Usable:
    value: int
    spread: tuple[float, float]
    plateau: float
    threshold: float
    rule: str
    note: str


PLATEAU_TOL = 0.075  # a working set is on the L2 plateau while its median is within 7.5% of the level


def _plateau(sizes, meds, l2_bytes, tol):
    """(plateau level, index of its first and last size) of a bandwidth vs working-set curve.

    The level is the median of the point medians over every working set up to the L2 size: the
    curve's bulk, which neither the near-partition bump of the smallest sets (served from the L2
    half next to the SM, faster) nor the fall past the usable capacity can move much. The plateau
    is the longest run of consecutive sizes within `tol` of that level."""
    inside = [i for i in range(len(sizes)) if l2_bytes is None or sizes[i] <= l2_bytes] or list(range(len(sizes)))
    level = float(np.median(meds[inside]))
    ok = np.abs(meds / level - 1.0) <= tol
    best, i = (0, -1), 0
    while i < len(sizes):
        if ok[i]:
            j = i
            while j + 1 < len(sizes) and ok[j + 1]:
                j += 1
            if j - i > best[1] - best[0]:
                best = (i, j)
            i = j + 1
        else:
            i += 1
    return level, best[0], best[1]


def l2_usable(sizes: Sequence[int], bw_samples: Sequence[np.ndarray], l2_bytes: int | None = None,
              tol: float = PLATEAU_TOL) -> L2Usable:
    """Largest working set on the L2 bandwidth plateau (the end of the plateau, found as a plateau).

    Level: the median of the point medians over the working sets up to `l2_bytes` (the driver's L2
    size; all sizes when None). Plateau: the longest run of consecutive working sets whose median
    read bandwidth lies within `tol` of that level. Value: its largest size; spread: (value, the
    next measured size), widened by the 5-95% range of the value over bootstrap resamples. The
    smallest sizes read faster still (the near L2 partition): they are not the plateau, and a
    rule that took them for it would answer the size of the near partition.
    """
    order = np.argsort(sizes)
    sizes = np.asarray(sizes, dtype=np.float64)[order]
    bw = [np.asarray(bw_samples[i], dtype=np.float64) for i in order]
    if sizes.size < 3:
        raise ValueError(f"l2_usable needs >= 3 working sets, got {sizes.size}")
    meds = np.array([np.median(s) for s in bw])
    level, i, j = _plateau(sizes, meds, l2_bytes, tol)
    if j < 0:
        raise ValueError("no working set lies on the L2 plateau (every median is more than "
                         f"{tol:.0%} from the level {level / 1e12:.2f} TB/s)")
    v = int(sizes[j])
    nxt = float(sizes[j + 1]) if j + 1 < sizes.size else float(v)
    rng = np.random.default_rng(SEED)
    boots = []
    for _ in range(N_BOOT):
        _, _, bj = _plateau(sizes, _boot_medians(bw, rng), l2_bytes, tol)
        boots.append(sizes[bj] if bj >= 0 else sizes[0])
    lo, hi = _pct(boots)
    note = (f"plateau {level / 1e12:.2f} TB/s from {sizes[i] / MIB:g} to {v / MIB:g} MiB (within {tol:.1%}); "
            f"fastest working set {sizes[int(np.argmax(meds))] / MIB:g} MiB at {meds.max() / 1e12:.2f} TB/s")
    if j == sizes.size - 1:
        note += "; no drop off the plateau up to the largest working set measured (value is a lower bound)"
    return L2Usable(v, (min(lo, v), max(hi, nxt)), level, (1 - tol) * level,
                    f"largest working set on the L2 bandwidth plateau: the longest run of consecutive working sets "
                    f"whose median read bandwidth lies within {tol:.1%} of the level (the median over every working "
                    "set up to the L2 size); spread: (value, next measured size) and the 5-95% range over "
                    f"{N_BOOT} bootstrap resamples", note)


# ------------------------------------------------------------------------------- prefetch budget
@dataclass(frozen=True)
class Budget:
    value: int
    spread: tuple[float, float]
    best_saving: float
    rule: str


def _budget(sizes, savings, significant, frac):
    ok = [i for i in range(len(sizes)) if significant[i] and savings[i] > 0]
    if not ok:
        return 0, 0.0
    best = max(savings[i] for i in ok)
    pick = min((i for i in ok if savings[i] >= frac * best), key=lambda i: sizes[i])
    return int(sizes[pick]), float(best)


def prefetch_budget(sizes: Sequence[int], nopf: Sequence[np.ndarray], pf: Sequence[np.ndarray],
                    frac: float = 0.9) -> Budget:
    """Smallest prefetched size whose saving is >= frac x the best significant saving (beyond it
    more prefetch buys < 10% more); 0 when no size saves significantly (faster() rule)."""
    diffs = [faster(a, b) for a, b in zip(nopf, pf)]
    v, best = _budget(sizes, [d.delta for d in diffs], [d.significant for d in diffs], frac)
    rng = np.random.default_rng(SEED)
    boots = []
    for _ in range(N_BOOT):
        s = [np.median(rng.choice(a, a.size)) - np.median(rng.choice(b, b.size)) for a, b in zip(nopf, pf)]
        boots.append(_budget(sizes, s, [d.significant for d in diffs], frac)[0])
    return Budget(v, _pct(boots), best,
                  f"smallest prefetched size whose saving (median no-prefetch minus median prefetch time) is >= "
                  f"{frac:.0%} of the best significant saving at the longest overlap measured; a saving counts when "
                  f"Mann-Whitney p < {SIGNIFICANCE} and it exceeds max({MIN_EFFECT:.0%}, 2x relative IQR); 0 if none "
                  f"does; spread: 5-95% over {N_BOOT} bootstrap resamples (significance held fixed)")


# ------------------------------------------------------------------------------- hot-expert bet
@dataclass(frozen=True)
class BreakEven:
    value: float
    spread: tuple[float, float]
    slope: float  # saving per unit overlap (s)
    intercept: float  # saving at overlap 0 (s), negative = cost of a wrong bet
    rule: str


def _break_even(overlaps, savings, right_pays: bool) -> tuple[float, float, float]:
    b, a = np.polyfit(np.asarray(overlaps, dtype=np.float64), np.asarray(savings, dtype=np.float64), 1)
    if not right_pays or b <= 0:
        return 1.0, float(b), float(a)
    return float(np.clip(-a / b, 0.0, 1.0)), float(b), float(a)


def break_even(overlaps: Sequence[float], nopf: np.ndarray, pf: Sequence[np.ndarray]) -> BreakEven:
    """Overlap at which the bet stops costing: saving(f) = a + b f fitted to median savings over
    the measured overlaps; break-even f* = -a/b clipped to [0, 1]; 1.0 (never bet) when the fully
    right bet does not save significantly or the fit does not rise with overlap."""
    if len(overlaps) < 2:
        raise ValueError("break-even needs at least two overlaps")
    nopf = np.asarray(nopf, dtype=np.float64)
    sav = [float(np.median(nopf) - np.median(p)) for p in pf]
    i_right = int(np.argmax(overlaps))
    right_pays = faster(nopf, pf[i_right]).significant
    v, b, a = _break_even(overlaps, sav, right_pays)
    rng = np.random.default_rng(SEED)
    boots = []
    for _ in range(N_BOOT):
        base = np.median(rng.choice(nopf, nopf.size))
        s = [base - np.median(rng.choice(p, len(p))) for p in pf]
        boots.append(_break_even(overlaps, s, right_pays)[0])
    return BreakEven(v, _pct(boots), b, a,
                     "least-squares line saving(f) = a + b*f through the median savings (no-prefetch minus prefetch "
                     "time) at each overlap f; break-even = -a/b clipped to [0, 1]; 1.0 (never bet) if the fully "
                     "right bet's saving is not significant (Mann-Whitney p < 0.01, > max(2%, 2x noise)) or b <= 0; "
                     f"spread: 5-95% over {N_BOOT} bootstrap resamples")


def hint_pays(baseline: np.ndarray, hinted: np.ndarray) -> tuple[int, Difference, tuple[float, float]]:
    """1 if the hinted configuration reads the reused set significantly faster (faster() rule);
    spread = range of the decision over bootstrap resamples judged by median gain > threshold."""
    d = faster(baseline, hinted)
    rng = np.random.default_rng(SEED)
    thr = max(MIN_EFFECT, 2.0 * d.noise)
    ma = np.median(baseline)
    dec = []
    for _ in range(N_BOOT):
        g = (np.median(rng.choice(baseline, baseline.size)) - np.median(rng.choice(hinted, hinted.size))) / ma
        dec.append(1 if (g > thr and d.p < SIGNIFICANCE) else 0)
    return int(d.significant), d, (float(min(dec)), float(max(dec)))
