"""Mapping per-SM %clock64 stamps onto one %globaltimer timeline.

%clock64 counts one SM's cycles: fine-grained but with an unknown offset per SM (and a rate
that follows the SM clock). %globaltimer is one clock for the whole GPU but ticks coarsely.
Pairs (clock64, globaltimer) read back to back on the same SM give, per group of stamps that
share a cycle counter (an SM, or an SM within one launch), an affine map

    globaltimer_ns ~= offset_g + rate * (clock64 - c_ref_g)

fitted by least squares with one rate shared by all groups (the SMs run off one clock; the
shared fit is far better conditioned than one rate per SM) or a rate given from elsewhere.
Quantisation of %globaltimer to its tick makes each pair uncertain by up to one tick, so the
best held-out residual to expect is about tick / sqrt(12) (uniform rounding error).

Times are kept relative to an integer origin (`origin_gt`): absolute %globaltimer values are
~1.7e18 ns, past the 2^53 integers a float64 holds exactly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class CalibrationError(ValueError):
    """The stamps cannot support the requested fit (too few points, no spread in clock64)."""


@dataclass(frozen=True)
class ClockCalibration:
    """Per-group affine maps clock64 -> globaltimer ns (relative to `origin_gt`)."""

    key_fields: tuple[str, ...]  # names of the grouping columns, e.g. ("sm",) or ("launch", "sm")
    keys: tuple[tuple[int, ...], ...]  # one per group
    c_ref: tuple[int, ...]  # per group: clock64 value the offset refers to (exact integer)
    offset_ns: tuple[float, ...]  # per group: globaltimer ns (minus origin) at c_ref
    ns_per_cycle: float  # shared rate (1 / SM clock in GHz)
    origin_gt: int
    n: tuple[int, ...]  # pairs per group
    rms_ns: float  # in-sample RMS residual over all pairs
    rate_given: bool = False
    group_rate_ppm: tuple[float, ...] = field(default=())  # per-group own-rate fit minus shared, ppm (nan if <3 pts)

    @property
    def sm_mhz(self) -> float:
        return 1e3 / self.ns_per_cycle

    def group_index(self, keys) -> np.ndarray:
        """Index into the groups for each row of `keys` (shape (n, len(key_fields)))."""
        k = np.asarray(keys, dtype=np.int64).reshape(-1, len(self.key_fields))
        lookup = {kk: i for i, kk in enumerate(self.keys)}
        idx = np.empty(len(k), dtype=np.int64)
        for i, row in enumerate(map(tuple, k.tolist())):
            if row not in lookup:
                raise CalibrationError(f"no calibration for {dict(zip(self.key_fields, row))}: "
                                       f"calibrated groups are {len(self.keys)} of {self.key_fields}")
            idx[i] = lookup[row]
        return idx

    def to_ns(self, keys, c64) -> np.ndarray:
        """clock64 stamps -> globaltimer ns relative to origin_gt (float64)."""
        g = self.group_index(keys)
        c = np.asarray(c64, dtype=np.uint64)
        cref = np.asarray(self.c_ref, dtype=np.uint64)[g]
        dc = (c - cref).astype(np.int64)  # wraps correctly for c < c_ref as well
        return np.asarray(self.offset_ns)[g] + dc.astype(np.float64) * self.ns_per_cycle

    def residual_ns(self, keys, c64, gt) -> np.ndarray:
        """map(clock64) - globaltimer for pairs not used in the fit (held-out check)."""
        gt_rel = (np.asarray(gt, dtype=np.uint64) - np.uint64(self.origin_gt)).astype(np.int64).astype(np.float64)
        return self.to_ns(keys, c64) - gt_rel

    def summary(self) -> dict:
        rates = np.asarray(self.group_rate_ppm, dtype=np.float64)
        rates = rates[np.isfinite(rates)]
        return {"groups": len(self.keys), "key_fields": list(self.key_fields), "sm_mhz": self.sm_mhz,
                "rate_given": self.rate_given, "rms_ns": self.rms_ns,
                "pairs_min": int(min(self.n)) if self.n else 0,
                "group_rate_ppm_p10_p90": ([float(np.percentile(rates, 10)), float(np.percentile(rates, 90))]
                                           if rates.size else None)}


def _as_keys(keys) -> np.ndarray:
    k = np.asarray(keys, dtype=np.int64)
    return k.reshape(-1, 1) if k.ndim == 1 else k


def fit_clock_calibration(keys, c64, gt, *, key_fields: Sequence[str] = ("sm",),
                          ns_per_cycle: float | None = None) -> ClockCalibration:
    """Fit per-group offsets and one shared rate (or use `ns_per_cycle` if given).

    keys: group of each pair (1-D, or 2-D with one column per key field); c64/gt: the pair.
    """
    k = _as_keys(keys)
    c = np.asarray(c64, dtype=np.uint64).ravel()
    g = np.asarray(gt, dtype=np.uint64).ravel()
    if not (len(k) == len(c) == len(g)):
        raise CalibrationError(f"keys/c64/gt lengths differ: {len(k)}, {len(c)}, {len(g)}")
    if k.shape[1] != len(key_fields):
        raise CalibrationError(f"{k.shape[1]} key columns but key_fields={tuple(key_fields)}")
    if len(c) < 2:
        raise CalibrationError("need at least two (clock64, globaltimer) pairs")
    if np.any(c == 0):
        raise CalibrationError(f"{int(np.sum(c == 0))} pairs have clock64 = 0: the kernel was not "
                               "compiled with MB_PROF_CLOCK64=1 (clock64 not recorded)")
    uniq, inv = np.unique(k, axis=0, return_inverse=True)
    inv = inv.ravel()
    origin = int(g.min())
    y = (g - np.uint64(origin)).astype(np.int64).astype(np.float64)
    ngroups = len(uniq)
    c_ref = np.zeros(ngroups, dtype=np.uint64)
    for i in range(ngroups):
        c_ref[i] = c[inv == i].min()
    x = (c - c_ref[inv]).astype(np.int64).astype(np.float64)
    counts = np.bincount(inv, minlength=ngroups).astype(np.float64)
    xbar = np.bincount(inv, weights=x, minlength=ngroups) / counts
    ybar = np.bincount(inv, weights=y, minlength=ngroups) / counts
    dx = x - xbar[inv]
    dy = y - ybar[inv]
    if ns_per_cycle is None:
        sxx = float(np.sum(dx * dx))
        if sxx <= 0:
            raise CalibrationError("clock64 does not vary within any group: cannot fit a rate "
                                   "(pass ns_per_cycle measured elsewhere)")
        rate = float(np.sum(dx * dy) / sxx)
        if not rate > 0:
            raise CalibrationError(f"fitted rate {rate} ns/cycle is not positive: clock64 and globaltimer disagree")
    else:
        rate = float(ns_per_cycle)
    offset = ybar - rate * xbar
    res = offset[inv] + rate * x - y
    rms = float(np.sqrt(np.mean(res * res)))
    own = np.full(ngroups, np.nan)
    for i in range(ngroups):
        m = inv == i
        sx = float(np.sum(dx[m] * dx[m]))
        if m.sum() >= 3 and sx > 0:
            own[i] = (float(np.sum(dx[m] * dy[m])) / sx / rate - 1.0) * 1e6
    return ClockCalibration(tuple(key_fields), tuple(tuple(int(v) for v in row) for row in uniq),
                            tuple(int(v) for v in c_ref), tuple(float(v) for v in offset), rate, origin,
                            tuple(int(v) for v in counts), rms, ns_per_cycle is not None,
                            tuple(float(v) for v in own))


def quantisation_floor_ns(tick_ns: float) -> float:
    """RMS error of a reading rounded to a `tick_ns` grid at a random phase: tick / sqrt(12)."""
    return float(tick_ns) / float(np.sqrt(12.0))
