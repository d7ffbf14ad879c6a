"""Turning the instruction-cache curves into constants. Pure functions of measured numbers (no
GPU), so CPU tests feed them synthetic curves with known answers.

Rules (each Derived carries its rule text):
- capacity: on the 1-warp curve (one warp issues without contention for its scheduler), a cache
  level is a *plateau*: a run of consecutive body sizes whose median cycles/instruction stay within
  LEVEL_TOL of each other and that spans at least a factor LEVEL_SPAN in body size. Points between
  two plateaus are a transition (partly missing), never a level of their own, so a denser sweep
  through a gradual transition adds transition points, not levels, and a single point that differs
  by a few percent is noise, not a step (the rule this replaces paired 11 and 19.3 KiB points 1.6%
  apart). A level's capacity is the largest body on its plateau whose cost is within LEVEL_EDGE of
  the plateau's median; spread = (that, the next measured body). The levels are named for what
  they are: the first plateau (near the issue rate) is the innermost instruction cache (an L0 per
  SM sub-partition), the last plateau, reaching the largest bodies measured (1 MiB, more code than
  any SM cache holds), is code served from L2, and the plateau before it is the SM's instruction
  cache, the study's "about 128 KB per SM". Plateaus in between are intermediate levels. The
  4-warp curve is a cross-check (same levels, noted); with 8 warps per SM two warps share each
  scheduler, and what its curve shows is contention, not a level (noted, never a constant).
- spliced: ratio = (A + B per-pass time spliced) / (A alone + B alone), and each block's own
  spliced/solo ratio. max_code_bytes_per_launch = the largest spliced kernel whose large block
  keeps its solo speed (its own ratio within SPLICE_TOLERANCE), the smallest such size over the
  warp counts measured; spread = (that, the smallest larger splice that slowed it). Small splices
  whose blocks fit the L0 alone slow down as soon as anything is added (they then run from the
  SM cache): they do not bound a launch's code and are noted, not counted.
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

LEVEL_TOL = 0.10  # points of one plateau lie within 10% of each other in cycles/instruction
LEVEL_SPAN = 1.5  # ... over at least a factor 1.5 in body size (the quick grid steps by 1.77)
LEVEL_EDGE = 0.05  # a level's capacity: its largest body within 5% of the plateau's median
MIN_REL_STEP = 0.15  # two plateaus less than 15% apart are one level (merged)
LEVEL_CURVE = 1  # warps per SM of the curve that defines the levels
CHECK_CURVE = 4  # the curve that cross-checks them
SPLICE_TOLERANCE = 0.05
PREFETCH_MIN_REL_STEP = 0.25
PREFETCH_WARM_FACTOR = 1.25


@dataclass(frozen=True)
class Plateau:
    sizes: tuple[float, ...]  # bodies on the plateau (ascending)
    cpis: tuple[float, ...]
    capacity: float  # largest body within LEVEL_EDGE of the median
    next_size: float | None  # the next measured body after the plateau (None: the plateau reaches the end)

    @property
    def level(self) -> float:
        return float(np.median(self.cpis))


def _runs(x: np.ndarray, y: np.ndarray, tol: float) -> list[tuple[int, int]]:
    """Maximal runs [i, j) of consecutive points whose values stay within `tol` of each other."""
    out, i = [], 0
    while i < x.size:
        j, lo, hi = i + 1, y[i], y[i]
        while j < x.size and max(hi, y[j]) <= (1 + tol) * min(lo, y[j]):
            lo, hi = min(lo, y[j]), max(hi, y[j])
            j += 1
        out.append((i, j))
        i = j
    return out


def plateaus(sizes, cpis, tol: float = LEVEL_TOL, span: float = LEVEL_SPAN,
             min_rel_step: float = MIN_REL_STEP) -> tuple[list[Plateau], list[float]]:
    """(plateaus ascending in size, transition sizes) of one cycles/instruction curve."""
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(cpis, dtype=np.float64)
    order = np.argsort(x)
    x, y = x[order], y[order]
    runs = [(i, j) for i, j in _runs(x, y, tol) if x[j - 1] >= span * x[i]]
    merged: list[list[int]] = []
    for i, j in runs:  # neighbouring plateaus closer than min_rel_step are one level
        if merged:
            pi, pj = merged[-1]
            a, b = float(np.median(y[pi:pj])), float(np.median(y[i:j]))
            if abs(b - a) < min_rel_step * min(a, b):
                merged[-1] = [pi, j]
                continue
        merged.append([i, j])
    out, inside = [], set()
    for i, j in merged:
        inside.update(range(i, j))
        med = float(np.median(y[i:j]))
        on = [k for k in range(i, j) if y[k] <= (1 + LEVEL_EDGE) * med]
        cap = float(x[max(on)])
        k_next = int(np.searchsorted(x, cap, side="right"))
        out.append(Plateau(tuple(map(float, x[i:j])), tuple(map(float, y[i:j])), cap,
                           float(x[k_next]) if k_next < x.size else None))
    return out, [float(x[k]) for k in range(x.size) if k not in inside]


def _bracket(x: np.ndarray, bp: float) -> tuple[float, float]:
    below = x[x < bp]
    above = x[x > bp]
    return float(below.max()), float(above.min())


def _fmt_bytes(b: float) -> str:
    return f"{b / 1024:.1f} KiB"


LEVEL_RULE = (f"plateaus of the {LEVEL_CURVE}-warp/SM cycles/instruction curve (runs of consecutive bodies within "
              f"{LEVEL_TOL:.0%} of each other spanning >= x{LEVEL_SPAN} in size; plateaus < {MIN_REL_STEP:.0%} apart "
              "merged; points between plateaus are transitions, not levels); value = the largest body on the plateau "
              f"within {LEVEL_EDGE:.0%} of its median, spread = (value, the next measured body)")


def derive_capacity(curves: Mapping[int, Sequence[tuple[float, float]]],
                    inputs: Mapping[int, Sequence[str]] | None = None) -> tuple[dict[str, Derived], list[str]]:
    """curves: {warps per SM: [(body bytes, median cycles/instruction), ...]}; the 1-warp curve
    is required (it defines the levels).

    Returns derived values (icache_l0_bytes, icache_sm_bytes, intermediate levels, the cost of
    missing each, each plateau's level) and notes (what was found, what was not, and why)."""
    for w, pts in curves.items():
        if len(pts) < 4:
            raise ValueError(f"capacity curve for {w} warps/SM has {len(pts)} points; need >= 4 to find levels")
    if LEVEL_CURVE not in curves:
        raise ValueError(f"no {LEVEL_CURVE}-warp/SM capacity curve: the levels are read from it "
                         f"(got curves for {sorted(curves)} warps/SM)")
    derived: dict[str, Derived] = {}
    notes: list[str] = []
    found = {}
    for w, pts in sorted(curves.items()):
        sizes, meds = zip(*pts)
        found[w] = plateaus(sizes, meds)
        ps, trans = found[w]
        notes.append(f"{w} warp(s)/SM: plateaus " + "; ".join(
            f"{p.level:.2f} cycles/instr up to {_fmt_bytes(p.capacity)}" for p in ps)
            + (f"; transition points at {', '.join(_fmt_bytes(t) for t in trans)}" if trans else ""))
    ins = tuple((inputs or {}).get(LEVEL_CURVE, ()))
    ps, _ = found[LEVEL_CURVE]
    x_max = max(s for s, _ in curves[LEVEL_CURVE])
    for k, p in enumerate(ps):
        derived[f"icache_plateau{k}_cpi_w{LEVEL_CURVE}"] = Derived(
            p.level, "cycles/instr", f"median of the point medians on plateau {k} (0 = smallest bodies) of the "
            f"{LEVEL_CURVE}-warp/SM curve; spread = their min and max", (min(p.cpis), max(p.cpis)), ins,
            f"bodies {_fmt_bytes(p.sizes[0])} .. {_fmt_bytes(p.sizes[-1])}")
    top_reaches_end = bool(ps) and ps[-1].next_size is None and ps[-1].sizes[-1] >= x_max
    if len(ps) < 2 or not top_reaches_end:
        notes.append("no cache level resolved: the 1-warp curve needs a first plateau and a last one reaching the "
                     "largest bodies (code served from L2); icache_l0_bytes / icache_sm_bytes not derived "
                     "(tune falls back to the documented defaults)")
        return derived, notes

    def level(key, p: Plateau, what: str, nxt: Plateau):
        hi = p.next_size if p.next_size is not None else p.capacity
        derived[key] = Derived(p.capacity, "B", f"{what}: {LEVEL_RULE}", (p.capacity, hi), ins,
                               f"{p.level:.2f} cycles/instr up to {_fmt_bytes(p.capacity)}, "
                               f"{nxt.level:.2f} beyond (first body off the level: "
                               f"{_fmt_bytes(hi)})")
        derived[key.replace("_bytes", f"_miss_cpi_w{LEVEL_CURVE}")] = Derived(
            nxt.level - p.level, "cycles/instr", f"cost of missing it: the next plateau's level minus this one's, "
            f"{LEVEL_CURVE} warp/SM", None, ins, f"{p.level:.2f} -> {nxt.level:.2f} cycles/instr")

    sm_i = len(ps) - 2
    level("icache_l0_bytes", ps[0], "the innermost instruction cache (L0, per SM sub-partition): the first plateau",
          ps[1])
    level("icache_sm_bytes", ps[sm_i], "the SM's instruction cache (the study's ~128 KB per SM): the last plateau "
          "below the L2-served one", ps[sm_i + 1])
    for m in range(1, sm_i):
        level(f"icache_mid{m}_bytes", ps[m], f"intermediate instruction-cache level {m}", ps[m + 1])
    if sm_i == 0:
        notes.append("only one SM-local plateau: the L0 and the SM's instruction cache are not told apart "
                     "(icache_l0_bytes = icache_sm_bytes)")
    elif sm_i > 1:
        notes.append(f"{sm_i - 1} intermediate level(s) between the L0 and the SM's instruction cache")
    # cross-check: the 4-warp curve's plateaus (same levels expected); 8 warps: contention only
    if CHECK_CURVE in found:
        cps, _ = found[CHECK_CURVE]
        for key in ("icache_l0_bytes", "icache_sm_bytes"):
            d = derived[key]
            hit = [p for p in cps if p.capacity <= d.spread[1] and (p.next_size or p.capacity) >= d.value]
            notes.append(f"{CHECK_CURVE} warps/SM cross-check of {key}: " + (
                f"a plateau ends at {_fmt_bytes(hit[0].capacity)} (agrees)" if hit else "no plateau ends inside "
                f"({_fmt_bytes(d.value)}, {_fmt_bytes(d.spread[1])}] (disagrees)"))
    for w in sorted(found):
        if w < 2 * 4:
            continue
        wp, _ = found[w]
        first = wp[0].capacity if wp else None
        if first is not None and first < derived["icache_l0_bytes"].value:
            notes.append(f"{w} warps/SM: cost rises past {_fmt_bytes(first)}, below the 1-warp L0 level: "
                         f"{w // 4} warps share each scheduler (issue contention), not a cache level (not a constant)")
    return derived, notes


@dataclass(frozen=True)
class SplicePoint:
    a_bytes: int
    b_bytes: int
    code_bytes: int  # machine code of the spliced kernel
    ratio: float  # spliced (A+B) / (A alone + B alone)
    spread: tuple[float, float]
    warps: int
    ratio_a: float | None = None  # block A's own spliced / solo per-pass time
    ratio_b: float | None = None

    @property
    def large_ratio(self) -> float:
        """The large block's own spliced / solo ratio (both blocks' worst when they are the same
        size); the whole-kernel ratio when the per-block ratios were not recorded."""
        if self.ratio_a is None or self.ratio_b is None:
            return self.ratio
        if self.a_bytes == self.b_bytes:
            return max(self.ratio_a, self.ratio_b)
        return self.ratio_a if self.a_bytes > self.b_bytes else self.ratio_b

    @property
    def label(self) -> str:
        return f"{self.a_bytes // 1024}K+{self.b_bytes // 1024}K"


MAX_CODE_RULE = ("largest spliced-kernel code size (cubin .text) whose large block keeps its solo speed (its own "
                 "spliced/solo per-pass time within {tol:.0%}), the smallest such size over the warps/SM counts "
                 "measured; spread = (value, the smallest larger splice that slowed its large block)")


def derive_max_code(points: Sequence[SplicePoint], tolerance: float = SPLICE_TOLERANCE,
                    inputs: Sequence[str] = ()) -> tuple[Derived | None, list[str]]:
    """max_code_bytes_per_launch over all warp counts (the smallest per-warp-count answer).

    Per warp count: the largest spliced kernel whose large block runs within `tolerance` of its
    solo speed. A splice smaller than that which slowed its large block is noted (its blocks ran
    from a faster level alone, typically the L0), not counted: it does not bound a launch's code."""
    notes = []
    per_w = {}
    for w in sorted({p.warps for p in points}):
        pts = sorted((p for p in points if p.warps == w), key=lambda p: (p.code_bytes, p.a_bytes))
        ok = [p for p in pts if p.large_ratio <= 1.0 + tolerance]
        if not ok:
            per_w[w] = (None, None)
            notes.append(f"{w} warp(s)/SM: no splice kept its large block within {tolerance:.0%} of solo speed "
                         f"(best x{min(p.large_ratio for p in pts):.3f})")
            continue
        best = max(ok, key=lambda p: p.code_bytes)
        above = [p for p in pts if p.code_bytes > best.code_bytes]
        broke = min(above, key=lambda p: p.code_bytes) if above else None
        below_bad = [p for p in pts if p.code_bytes < best.code_bytes and p.large_ratio > 1.0 + tolerance]
        per_w[w] = (best, broke)
        notes.append(f"{w} warp(s)/SM: {best.label} ({best.code_bytes} B) keeps its large block at "
                     f"x{best.large_ratio:.3f} of solo" + (f"; {broke.label} ({broke.code_bytes} B) slows it "
                                                          f"x{broke.large_ratio:.3f}" if broke else
                                                          "; nothing larger was measured (lower bound)")
                     + (f"; smaller splices slowed by more than {tolerance:.0%}: "
                        + ", ".join(f"{p.label} x{p.large_ratio:.3f}" for p in below_bad)
                        + " (their blocks fit a faster level alone)" if below_bad else ""))
    usable = {w: v for w, v in per_w.items() if v[0] is not None}
    if not usable:
        return None, notes + ["max_code_bytes_per_launch not derived: no splice kept its large block at solo speed"]
    w_min = min(usable, key=lambda w: usable[w][0].code_bytes)
    best = usable[w_min][0]
    brokes = [v[1].code_bytes for v in usable.values() if v[1] is not None and v[1].code_bytes > best.code_bytes]
    hi = float(min(brokes)) if brokes else float(best.code_bytes)
    if any(v[0] is None for v in per_w.values()):
        notes.append("some warp counts kept no large block at solo speed: the value comes from the others")
    d = Derived(float(best.code_bytes), "B", MAX_CODE_RULE.format(tol=tolerance), (float(best.code_bytes), hi),
                tuple(inputs), f"set by the {w_min} warp(s)/SM runs ({best.label}, large block "
                f"x{best.large_ratio:.3f})" + ("" if brokes else "; nothing larger slowed it: lower bound"))
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


# ------------------------------------------------------------------------------- from a result
def capacity_curves(series) -> tuple[dict[int, list[tuple[float, float]]], dict[int, list[str]]]:
    """{warps: [(body bytes, median cycles/instruction)]} and the series names, from the
    capacity/w<W>/<B>B series of an icache.capacity result (what run_capacity derives from)."""
    curves: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, list[str]] = {}
    for s in series:
        if not s.name.startswith("capacity/"):
            continue
        w = int(s.params["warps_per_sm"])
        curves.setdefault(w, []).append((float(s.params["code_bytes"]), s.summary.median))
        names.setdefault(w, []).append(s.name)
    return curves, names


def splice_points(series) -> list[SplicePoint]:
    """The spliced/w<W>/<A>B+<B>B series of an icache.spliced result as SplicePoints."""
    out = []
    for s in series:
        if not s.name.startswith("spliced/"):
            continue
        m = s.metrics
        out.append(SplicePoint(int(s.params["a_bytes"]), int(s.params["b_bytes"]), int(m["kernel_code_bytes"]),
                               float(m["ratio_total"]), (float(m["ratio_total_lo"]), float(m["ratio_total_hi"])),
                               int(s.params["warps_per_sm"]), float(m["ratio_a"]), float(m["ratio_b"])))
    return out


def rederive_capacity(result) -> dict[str, Derived]:
    curves, names = capacity_curves(result.series)
    return derive_capacity(curves, names)[0]


def rederive_spliced(result) -> dict[str, Derived]:
    pts = splice_points(result.series)
    out = {}
    for p in pts:
        for blk, r in (("a", p.ratio_a), ("b", p.ratio_b)):
            out[f"spliced_block_{blk}_ratio_w{p.warps}_{p.a_bytes // 1024}K_{p.b_bytes // 1024}K"] = Derived(
                r, "", f"block {blk.upper()}'s own median per-pass cycles in the spliced loop / alone (re-derived "
                "from the recorded per-block ratio: no spread)", None, ())
    d, _ = derive_max_code(pts, inputs=tuple(s.name for s in result.series if s.name.startswith("spliced/")))
    if d is not None:
        out["max_code_bytes_per_launch"] = d
    return out
