"""Pure-numpy analysis of what the clocks probes bring back (tested on the CPU with synthetic data).

Each checker raises CorrectnessError naming what is wrong; a benchmark never times or reports
on data that failed its checker.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CorrectnessError
from ..stats import bootstrap_ci
from .calibrate import ClockCalibration, fit_clock_calibration, quantisation_floor_ns


# ====================================================================================== tick
@dataclass(frozen=True)
class TickStats:
    """What back-to-back %globaltimer reads showed. tick_ns = smallest nonzero increment."""

    tick_ns: int
    per_block_min_ns: tuple[int, ...]
    gcd_ns: int
    mode_ns: int
    increments_ns: np.ndarray  # every increment seen (all blocks)
    period_cycles: np.ndarray  # %clock64 cycles between consecutive changes (same block)
    reads_per_change: float
    hist: dict[int, int]  # increment -> count (the 12 most common)
    blocks: int
    changes: int
    stop_reasons: dict[str, int]

    def to_dict(self) -> dict:
        return {"tick_ns": self.tick_ns, "per_block_min_ns": list(self.per_block_min_ns), "gcd_ns": self.gcd_ns,
                "mode_ns": self.mode_ns, "reads_per_change": self.reads_per_change,
                "hist": {str(k): v for k, v in self.hist.items()}, "blocks": self.blocks, "changes": self.changes,
                "stop_reasons": self.stop_reasons,
                "period_cycles_median": float(np.median(self.period_cycles)) if self.period_cycles.size else None}


_STOP = {1: "max_changes", 2: "max_reads", 3: "max_ns"}


def analyse_tick(inc: np.ndarray, cyc: np.ndarray, info: np.ndarray, min_changes: int = 8) -> TickStats:
    """inc/cyc: (blocks, max_changes) as written by clk_tick_probe; info: (blocks, 4)."""
    inc = np.asarray(inc, dtype=np.uint64)
    cyc = np.asarray(cyc, dtype=np.uint64)
    info = np.asarray(info, dtype=np.int64).reshape(-1, 4)
    B = info.shape[0]
    incs, periods, mins = [], [], []
    reads = changes = 0
    reasons: dict[str, int] = {}
    for b in range(B):
        n, r, _sm, why = (int(v) for v in info[b])
        if n < min_changes:
            raise CorrectnessError(f"tick probe block {b}: %globaltimer changed only {n} times in {r} reads "
                                   f"(stop reason {_STOP.get(why, why)}): the timer is stalled or far coarser "
                                   "than the probe's time budget")
        x = inc[b, :n]
        if np.any(x == 0):
            raise CorrectnessError(f"tick probe block {b}: a zero increment was logged (probe logic broken)")
        if np.any(x > np.uint64(10**12)):
            raise CorrectnessError(f"tick probe block {b}: increment of {int(x.max())} ns (> 1000 s): garbage")
        c = cyc[b, :n].astype(np.int64)
        if np.any(np.diff(c) <= 0):
            raise CorrectnessError(f"tick probe block {b}: %clock64 did not increase between globaltimer changes")
        incs.append(x.astype(np.int64))
        periods.append(np.diff(c))
        mins.append(int(x.min()))
        reads += r
        changes += n
        reasons[_STOP.get(why, str(why))] = reasons.get(_STOP.get(why, str(why)), 0) + 1
    allinc = np.concatenate(incs)
    vals, counts = np.unique(allinc, return_counts=True)
    order = np.argsort(-counts)[:12]
    return TickStats(int(allinc.min()), tuple(mins), int(np.gcd.reduce(allinc)), int(vals[np.argmax(counts)]),
                     allinc, np.concatenate(periods), reads / changes,
                     {int(vals[i]): int(counts[i]) for i in order}, B, changes, reasons)


# ====================================================================================== rate
def analyse_rate(out: np.ndarray) -> dict[str, np.ndarray]:
    """clk_rate_probe output (blocks, 5) -> per-block cycles, ns, MHz, smid (checked)."""
    o = np.asarray(out, dtype=np.uint64).reshape(-1, 5)
    dg = (o[:, 2] - o[:, 0]).astype(np.int64)
    dc = (o[:, 3] - o[:, 1]).astype(np.int64)
    if np.any(dg <= 0) or np.any(dc <= 0):
        b = int(np.argmax((dg <= 0) | (dc <= 0)))
        raise CorrectnessError(f"rate probe block {b}: globaltimer advanced {dg[b]} ns and clock64 {dc[b]} cycles")
    mhz = dc / dg * 1e3
    if np.any(mhz < 10) or np.any(mhz > 10000):
        raise CorrectnessError(f"rate probe: implausible SM clock {mhz.min():.1f}..{mhz.max():.1f} MHz")
    return {"cycles": dc, "ns": dg, "mhz": mhz, "sm": o[:, 4].astype(np.int64)}


# ====================================================================================== skew
def check_skew(gt: np.ndarray, c64: np.ndarray, sm: np.ndarray, sm_count: int | None = None) -> None:
    """Every stamper stamped every trial, once per SM, with both clocks moving forward."""
    gt = np.asarray(gt, dtype=np.uint64)
    c64 = np.asarray(c64, dtype=np.uint64)
    sm = np.asarray(sm, dtype=np.int64)
    T, B = gt.shape
    if c64.shape != (T, B) or sm.shape != (B,):
        raise CorrectnessError(f"skew: shapes gt {gt.shape}, c64 {c64.shape}, sm {sm.shape} disagree")
    if np.any(gt == 0) or np.any(c64 == 0):
        t, b = np.argwhere((gt == 0) | (c64 == 0))[0]
        raise CorrectnessError(f"skew: block {b} did not stamp trial {t + 1}")
    uniq, cnt = np.unique(sm, return_counts=True)
    if np.any(cnt > 1):
        raise CorrectnessError(f"skew: SMs {uniq[cnt > 1].tolist()} hold more than one stamper block "
                               "(one block per SM was required)")
    if sm_count is not None and B != sm_count:
        raise CorrectnessError(f"skew: {B} stamper blocks for {sm_count} SMs")
    if T > 1:
        dg = np.diff(gt.astype(np.int64), axis=0)
        dc = np.diff(c64.astype(np.int64), axis=0)
        if np.any(dg < 0) or np.any(dc <= 0):
            t, b = np.argwhere((dg < 0) | (dc <= 0))[0]
            raise CorrectnessError(f"skew: block {b} stamps go backwards between trials {t + 1} and {t + 2}")


def spread(x: np.ndarray, lo: float = 10, hi: float = 90) -> np.ndarray:
    """Per row: percentile hi - percentile lo across columns."""
    p = np.percentile(np.asarray(x, dtype=np.float64), [lo, hi], axis=1)
    return p[1] - p[0]


@dataclass(frozen=True)
class SkewStats:
    trials: int
    blocks: int
    tick_ns: float
    gt_spread_p90_p10: np.ndarray  # per trial, ns (globaltimer as read)
    gt_spread_max_min: np.ndarray
    sm_skew_ns: float  # mean over trials of gt p90-p10
    sm_skew_ci: tuple[float, float]
    calibration: ClockCalibration  # fitted on the training trials
    heldout_residual_ns: np.ndarray  # map(clock64) - globaltimer, every held-out pair
    heldout_rms_per_trial: np.ndarray
    calibrated_spread_p90_p10: np.ndarray  # per held-out trial, ns on the calibrated clock64 timeline
    per_sm_lateness_ns: np.ndarray  # per block: mean (calibrated time - trial median), held-out trials
    sm: np.ndarray

    @property
    def residual_rms_ns(self) -> float:
        r = self.heldout_residual_ns
        return float(np.sqrt(np.mean(r * r)))

    @property
    def quantisation_floor_ns(self) -> float:
        return quantisation_floor_ns(self.tick_ns)


def analyse_skew(gt: np.ndarray, c64: np.ndarray, sm: np.ndarray, tick_ns: float) -> SkewStats:
    """Spread of the release as globaltimer saw it, and a per-SM clock64 calibration fitted on
    even trials and judged on odd ones (held out)."""
    gt = np.asarray(gt, dtype=np.uint64)
    c64 = np.asarray(c64, dtype=np.uint64)
    sm = np.asarray(sm, dtype=np.int64)
    T, B = gt.shape
    if T < 4:
        raise CorrectnessError(f"skew analysis needs at least 4 trials (train/held-out split), got {T}")
    origin = gt.min()
    rel = (gt - origin).astype(np.int64).astype(np.float64)
    s_pp = spread(rel)
    s_mm = rel.max(axis=1) - rel.min(axis=1)
    ci = bootstrap_ci(s_pp, stat=np.mean)
    train = np.arange(0, T, 2)
    test = np.arange(1, T, 2)
    keys = np.broadcast_to(sm, (T, B))
    cal = fit_clock_calibration(keys[train].ravel(), c64[train].ravel(), gt[train].ravel(), key_fields=("sm",))
    res = cal.residual_ns(keys[test].ravel(), c64[test].ravel(), gt[test].ravel()).reshape(len(test), B)
    t_cal = cal.to_ns(keys[test].ravel(), c64[test].ravel()).reshape(len(test), B)
    late = (t_cal - np.median(t_cal, axis=1, keepdims=True)).mean(axis=0)
    return SkewStats(T, B, float(tick_ns), s_pp, s_mm, float(np.mean(s_pp)), ci, cal, res.ravel(),
                     np.sqrt(np.mean(res * res, axis=1)), spread(t_cal), late, sm)


# ====================================================================================== launch chains
CHAIN_METRICS = {
    "land_after_same_sm_exit": "block of k+1 lands minus the exit of launch k's block on the same SM",
    "land_after_last_exit": "block of k+1 lands minus launch k's last block exit",
    "land_after_first_exit": "block of k+1 lands minus launch k's first block exit",
    "release_after_last_exit": "griddepcontrol.wait returns in k+1 minus launch k's last block exit",
    "wait_in_griddepcontrol": "griddepcontrol.wait return minus landing, same block",
}


def analyse_chain(tl) -> dict[str, np.ndarray]:
    """Per block of launches 1..N-1 of a chain (a Timeline of the LAUNCH events), in ns."""
    land = tl.first("griddep_wait_begin")
    go = tl.first("griddep_wait_end")
    out_ = tl.first("work_end")
    s = tl.stamps
    sm_of = {}
    for i in range(len(s)):
        sm_of[(int(s.launch[i]), int(s.block[i]))] = int(s.sm[i])
    nl = s.launches
    blocks = s.layout.blocks
    for L in range(nl):
        for b in range(blocks):
            for what, d in (("landing", land), ("release", go), ("exit", out_)):
                if (L, b, 0) not in d:
                    raise CorrectnessError(f"chain: launch {L} block {b} has no {what} stamp")
    res: dict[str, list[float]] = {k: [] for k in CHAIN_METRICS}
    for L in range(1, nl):
        ex = {b: out_[(L - 1, b, 0)] for b in range(blocks)}
        per_sm: dict[int, float] = {}
        for b, t in ex.items():
            smb = sm_of[(L - 1, b)]
            per_sm[smb] = max(per_sm.get(smb, -np.inf), t)
        last, first = max(ex.values()), min(ex.values())
        for b in range(blocks):
            t_land, t_go = land[(L, b, 0)], go[(L, b, 0)]
            smb = sm_of[(L, b)]
            if smb in per_sm:
                res["land_after_same_sm_exit"].append(t_land - per_sm[smb])
            res["land_after_last_exit"].append(t_land - last)
            res["land_after_first_exit"].append(t_land - first)
            res["release_after_last_exit"].append(t_go - last)
            res["wait_in_griddepcontrol"].append(t_go - t_land)
    return {k: np.asarray(v, dtype=np.float64) for k, v in res.items()}


# ====================================================================================== instrumentation
def expected_instr_stamps(phases: int, repeat: int) -> int:
    """Stamps lane 0 of warp 0 writes per block per launch in instr.cu."""
    return (2 * phases + 2 * (phases - 1)) * repeat


def instr_reference(x0, coef, phases: int, nblocks: int):
    """Exact torch reference of instr.cu's output buffer (uint32 arithmetic in int64)."""
    import torch  # heavy: torch

    x = x0.to(torch.int64).reshape(nblocks, -1) & 0xFFFFFFFF
    for p in range(phases):
        src = (torch.arange(nblocks, device=x.device) + p + 1) % nblocks
        a = int(coef[2 * p]) & 0xFFFFFFFF
        c = int(coef[2 * p + 1]) & 0xFFFFFFFF
        x = (x[src] * a + c) & 0xFFFFFFFF
    return x.reshape(-1)


def fit_cost_per_stamp(stamps: np.ndarray, samples: list[np.ndarray], n_boot: int = 400, seed: int = 0):
    """Least-squares slope of median device time against stamps per block; 5-95% bootstrap
    interval from resampling each series. Returns (slope_s, intercept_s, (lo, hi))."""
    x = np.asarray(stamps, dtype=np.float64)
    med = np.array([np.median(s) for s in samples])
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, c), *_ = np.linalg.lstsq(A, med, rcond=None)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        m = np.array([np.median(rng.choice(s, size=len(s))) for s in samples])
        boots.append(np.linalg.lstsq(A, m, rcond=None)[0][1])
    lo, hi = np.percentile(boots, [5, 95])
    return float(c), float(a), (float(lo), float(hi))


def median_difference_ci(a, b, n_boot: int = 1000, seed: int = 0) -> tuple[float, tuple[float, float]]:
    """median(b) - median(a) with a 5-95% bootstrap interval."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    d = [np.median(rng.choice(b, b.size)) - np.median(rng.choice(a, a.size)) for _ in range(n_boot)]
    lo, hi = np.percentile(d, [5, 95])
    return float(np.median(b) - np.median(a)), (float(lo), float(hi))
