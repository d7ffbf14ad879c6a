"""Turning the instruction-cache curves into constants. Pure functions of measured numbers (no
GPU), so CPU tests feed them synthetic curves with known answers.

Rules (each Derived carries its rule text):
- capacity: fit a step function (microbench.stats.fit_steps, BIC) to median cycles/instruction
  against body bytes, separately for each warps-per-SM curve; every upward step is a cache level
  boundary. Steps from different curves whose breakpoints lie within a factor CLUSTER_RATIO of
  each other are the same level. A level's capacity is the largest body measured at the cheaper
  side of its step (smallest over curves: conservative, a body that size ran from that level);
  spread = (that, the smallest body measured on the dearer side, over curves).
- spliced: ratio = (A + B per-pass time spliced) / (A alone + B alone). max_code_bytes_per_launch
  = the largest spliced kernel code size whose ratio stays within SPLICE_TOLERANCE while every
  smaller tested one does too; spread = (that size, the first size that broke the rule).
- launch prefetch: fit steps to the cold first-pass cycles/instruction of each code segment
  against its end offset (segment 0, which also pays the warp's start, is left out); the window
  ends at the last segment of the first level when the next level is dearer.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..results import Derived
from ..stats import fit_steps

CLUSTER_RATIO = 1.6
MIN_REL_STEP = 0.15  # a step smaller than 15% of the lower level is noise, not a cache level
SPLICE_TOLERANCE = 0.05
PREFETCH_MIN_REL_STEP = 0.25
PREFETCH_WARM_FACTOR = 1.25


@dataclass(frozen=True)
class Step:
    warps: int
    breakpoint: float  # geometric mean of the bracketing sizes (fit_steps' estimate)
    lo: float  # largest measured size on the cheaper side
    hi: float  # smallest measured size on the dearer side
    before: float  # level (cycles/instr) below the step
    after: float  # level above it


def _bracket(x: np.ndarray, bp: float) -> tuple[float, float]:
    below = x[x < bp]
    above = x[x > bp]
    return float(below.max()), float(above.min())


def curve_steps(sizes, medians, warps: int, *, max_levels: int = 5, min_rel_step: float = MIN_REL_STEP):
    """(fit, upward steps, downward steps) of one cycles/instruction curve."""
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(medians, dtype=np.float64)
    order = np.argsort(x)
    x, y = x[order], y[order]
    fit = fit_steps(x, y, max_levels=max_levels, min_points=2, min_rel_step=min_rel_step)
    up, down = [], []
    for i, bp in enumerate(fit.breakpoints):
        lo, hi = _bracket(x, bp)
        s = Step(warps, bp, lo, hi, fit.levels[i], fit.levels[i + 1])
        (up if s.after > s.before else down).append(s)
    return fit, up, down


def _fmt_bytes(b: float) -> str:
    return f"{b / 1024:.1f} KiB"


def derive_capacity(curves: Mapping[int, Sequence[tuple[float, float]]],
                    inputs: Mapping[int, Sequence[str]] | None = None) -> tuple[dict[str, Derived], list[str]]:
    """curves: {warps per SM: [(body bytes, median cycles/instruction), ...]}.

    Returns derived constants (icache_l1_bytes, icache_l2_bytes, ... , per-curve level costs)
    and notes (what was found, what was not)."""
    derived: dict[str, Derived] = {}
    notes: list[str] = []
    all_up: list[Step] = []
    fits = {}
    for w, pts in sorted(curves.items()):
        if len(pts) < 4:
            raise ValueError(f"capacity curve for {w} warps/SM has {len(pts)} points; need >= 4 to fit steps")
        sizes, meds = zip(*pts)
        fit, up, down = curve_steps(sizes, meds, w)
        fits[w] = (np.asarray(sizes, dtype=np.float64), np.asarray(meds, dtype=np.float64), fit)
        all_up += up
        notes.append(f"{w} warp(s)/SM: levels " + ", ".join(f"{v:.2f}" for v in fit.levels) + " cycles/instr"
                     + (", steps at " + ", ".join(_fmt_bytes(b) for b in fit.breakpoints) if fit.breakpoints else
                        ", no step"))
        for s in down:
            notes.append(f"{w} warp(s)/SM: cost falls by {s.before - s.after:.2f} cycles/instr past "
                         f"{_fmt_bytes(s.breakpoint)} (not a cache level; left out)")
    # cluster upward steps across curves into levels
    clusters: list[list[Step]] = []
    for s in sorted(all_up, key=lambda s: s.breakpoint):
        if clusters and s.breakpoint <= max(t.breakpoint for t in clusters[-1]) * CLUSTER_RATIO:
            clusters[-1].append(s)
        else:
            clusters.append([s])
    ins = tuple(n for names in (inputs or {}).values() for n in names)
    for c, members in enumerate(clusters):
        lo = min(s.lo for s in members)
        hi = max(s.hi for s in members)
        ws = sorted({s.warps for s in members})
        key = f"icache_l{c + 1}_bytes"
        derived[key] = Derived(
            lo, "B",
            f"level {c + 1} of the instruction cache: upward steps of the fitted cycles/instruction curves "
            f"(fit_steps, BIC, steps < {MIN_REL_STEP:.0%} merged) clustered across warps/SM (breakpoints within "
            f"x{CLUSTER_RATIO}); value = largest body measured on the cheaper side (min over curves), spread = "
            f"(value, smallest body on the dearer side)", (lo, hi), ins,
            f"seen in curves with {ws} warps/SM; breakpoints " + ", ".join(_fmt_bytes(s.breakpoint) for s in members))
        for s in members:
            derived[f"icache_l{c + 1}_miss_cpi_w{s.warps}"] = Derived(
                s.after - s.before, "cycles/instr",
                f"cost of missing level {c + 1}: fitted level above minus level below its step, {s.warps} warps/SM",
                None, ins, f"{s.before:.2f} -> {s.after:.2f} cycles/instr at {_fmt_bytes(s.breakpoint)}")
    for w, (x, y, fit) in fits.items():
        idx = np.searchsorted(np.asarray(fit.breakpoints), x, side="right")
        for k, level in enumerate(fit.levels):
            seg = y[idx == k]
            derived[f"icache_level{k}_cpi_w{w}"] = Derived(
                level, "cycles/instr", f"fitted level {k} (0 = smallest bodies) of the {w} warp(s)/SM curve; "
                "spread = min/max of the point medians in the level",
                (float(seg.min()), float(seg.max())), ins,
                f"bodies {_fmt_bytes(x[idx == k].min())} .. {_fmt_bytes(x[idx == k].max())}")
    if not clusters:
        notes.append("no upward step in any curve: no cache level resolved in the swept range; "
                     "icache_l1_bytes/icache_l2_bytes not derived (tune falls back to defaults)")
    elif len(clusters) == 1:
        notes.append(f"one cache level resolved ({_fmt_bytes(derived['icache_l1_bytes'].value)}); "
                     "icache_l2_bytes not derived")
    return derived, notes


@dataclass(frozen=True)
class SplicePoint:
    a_bytes: int
    b_bytes: int
    code_bytes: int  # machine code of the spliced kernel
    ratio: float  # spliced (A+B) / (A alone + B alone)
    spread: tuple[float, float]
    warps: int


def derive_max_code(points: Sequence[SplicePoint], tolerance: float = SPLICE_TOLERANCE,
                    inputs: Sequence[str] = ()) -> tuple[Derived | None, list[str]]:
    """max_code_bytes_per_launch over all warp counts (the smallest per-warp-count answer)."""
    notes = []
    per_w = {}
    for w in sorted({p.warps for p in points}):
        pts = sorted((p for p in points if p.warps == w), key=lambda p: (p.code_bytes, p.a_bytes))
        ok = None
        broke = None
        for p in pts:
            if p.ratio <= 1.0 + tolerance:
                if broke is None:
                    ok = p
            elif broke is None:
                broke = p
        per_w[w] = (ok, broke)
        if ok is None:
            notes.append(f"{w} warp(s)/SM: even the smallest spliced kernel ({pts[0].code_bytes} B) was "
                         f"{pts[0].ratio:.3f}x its parts")
        elif broke is None:
            notes.append(f"{w} warp(s)/SM: no spliced kernel up to {ok.code_bytes} B slowed by more than "
                         f"{tolerance:.0%} (value is a lower bound)")
        else:
            notes.append(f"{w} warp(s)/SM: within {tolerance:.0%} up to {ok.code_bytes} B "
                         f"({_fmt_bytes(ok.a_bytes)}+{_fmt_bytes(ok.b_bytes)}, x{ok.ratio:.3f}); "
                         f"{broke.code_bytes} B ({_fmt_bytes(broke.a_bytes)}+{_fmt_bytes(broke.b_bytes)}) "
                         f"was x{broke.ratio:.3f}")
    usable = {w: v for w, v in per_w.items() if v[0] is not None}
    if not usable:
        return None, notes + ["max_code_bytes_per_launch not derived: no tested size passed"]
    w_min = min(usable, key=lambda w: usable[w][0].code_bytes)
    ok, broke = usable[w_min]
    hi = broke.code_bytes if broke is not None else ok.code_bytes
    if any(v[0] is None for v in per_w.values()):
        notes.append("some warp counts failed even the smallest size: value comes from the others")
    d = Derived(float(ok.code_bytes), "B",
                f"largest spliced-kernel code size (cubin .text) whose per-pass time stays within "
                f"{tolerance:.0%} of its two blocks run alone, with every smaller tested size also within it; "
                f"the smallest such size over warps/SM counts; spread = (value, first size that broke the rule)",
                (float(ok.code_bytes), float(hi)), tuple(inputs),
                f"set by the {w_min} warp(s)/SM runs" + ("" if broke is not None else "; nothing broke: lower bound"))
    return d, notes


def derive_prefetch(seg_end_offsets, cold_cpi, warm_cpi, total_bytes: float, inputs: Sequence[str] = (),
                    state: str = "icache_cold") -> tuple[Derived, list[str]]:
    """launch_prefetch_bytes from per-segment first-pass costs (medians over warps/launches)."""
    x = np.asarray(seg_end_offsets, dtype=np.float64)[1:]
    cold = np.asarray(cold_cpi, dtype=np.float64)[1:]
    warm = np.asarray(warm_cpi, dtype=np.float64)[1:]
    if x.size < 4:
        raise ValueError(f"prefetch probe has {x.size + 1} segments; need >= 5")
    fit = fit_steps(x, cold, max_levels=4, min_points=2, min_rel_step=PREFETCH_MIN_REL_STEP)
    warm_med = float(np.median(warm))
    notes = [f"{state} first pass: levels " + ", ".join(f"{v:.2f}" for v in fit.levels)
             + " cycles/instr" + (" with steps at " + ", ".join(_fmt_bytes(b) for b in fit.breakpoints)
                                  if fit.breakpoints else " (flat)") + f"; warm median {warm_med:.2f}"]
    rule = (f"fit_steps on the {state} first-pass cycles/instruction of each code segment against its end offset "
            f"from the first stamp (segment 0 left out: it also pays the warp's start); the window ends at the last "
            f"segment of the first level if the next level is >= {PREFETCH_MIN_REL_STEP:.0%} dearer; a flat curve "
            f"within {PREFETCH_WARM_FACTOR}x of warm means the whole probe ({_fmt_bytes(total_bytes)}) was near the "
            f"SM (lower bound), a flat dearer one means no window (0)")
    if fit.breakpoints and fit.levels[1] > fit.levels[0]:
        lo, hi = _bracket(x, fit.breakpoints[0])
        return Derived(lo, "B", rule, (lo, hi), tuple(inputs),
                       f"first level {fit.levels[0]:.2f} -> {fit.levels[1]:.2f} cycles/instr"), notes
    if not fit.breakpoints:
        level = fit.levels[0]
        if level <= PREFETCH_WARM_FACTOR * warm_med:
            return Derived(float(total_bytes), "B", rule, (float(total_bytes), float(total_bytes)), tuple(inputs),
                           "cold first pass as cheap as warm over the whole probe: window >= probe size"), notes
        return Derived(0.0, "B", rule, (0.0, float(x[0])), tuple(inputs),
                       f"cold first pass uniformly {level / warm_med:.2f}x warm: no launch-time window seen"), notes
    notes.append("cold first pass starts dearer and gets cheaper (the first step is downward): no window")
    return Derived(0.0, "B", rule, (0.0, float(x[0])), tuple(inputs), "first step downward"), notes


def bootstrap_ratio(num_parts: Sequence[np.ndarray], den_parts: Sequence[np.ndarray], n_boot: int = 400,
                    seed: int = 0) -> tuple[float, tuple[float, float]]:
    """Ratio of sums of medians (num/den), with a 5-95% bootstrap interval over resampled samples."""
    rng = np.random.default_rng(seed)

    def med_sum(parts, boot):
        tot = 0.0
        for p in parts:
            p = np.asarray(p, dtype=np.float64)
            tot += float(np.median(rng.choice(p, size=p.size) if boot else p))
        return tot

    r = med_sum(num_parts, False) / med_sum(den_parts, False)
    rs = [med_sum(num_parts, True) / med_sum(den_parts, True) for _ in range(n_boot)]
    lo, hi = np.percentile(rs, [5, 95])
    return r, (float(lo), float(hi))
