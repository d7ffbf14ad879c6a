"""Pure-numpy analysis of the sync measurements and the rules that derive the tuned constants.

Everything here runs without a GPU (CPU tests feed it synthetic stamps). Each rule is stated in
the docstring and carried verbatim into the Derived record.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..stats import bootstrap_ci, mann_whitney

# ---------------------------------------------------------------------------- ping-pong stamps


@dataclass(frozen=True)
class OneWay:
    """One ping-pong launch, in cycles of the SM clock (per-SM %clock64, offset removed)."""

    rtt: np.ndarray  # initiator round trips, measured rounds
    a_to_b: np.ndarray  # initiator -> responder (responder polls), measured rounds
    b_to_a: np.ndarray  # responder -> initiator (initiator polls), measured rounds
    offset: float  # responder clock - initiator clock, from the calibration rounds
    offset_iqr: float  # spread of the per-round offset estimates (calibration quality)
    calib_rtt: np.ndarray  # round trips of the idle calibration rounds


def split_one_way(init: np.ndarray, resp: np.ndarray, calib: int, settle: int) -> OneWay:
    """Stamps -> one-way latencies.

    init[j] = (send, receive) of round j on the initiator's clock; resp[j] = (receive, send) on
    the responder's. Clocks of two SMs tick at one rate but start apart (offset). In the idle
    calibration rounds the two one-way trips are assumed equal, which gives
        offset_j = ((resp_recv - init_send) - (init_recv - resp_send)) / 2,
    the median of which is then used for every later round:
        a_to_b = resp_recv - init_send - offset,  b_to_a = init_recv - resp_send + offset.
    Rounds [calib, calib + settle) are discarded (the load is ramping up).
    """
    init = np.asarray(init, dtype=np.int64)
    resp = np.asarray(resp, dtype=np.int64)
    if init.shape != resp.shape or init.ndim != 2 or init.shape[1] != 2:
        raise ValueError(f"stamps must be [rounds, 2] on both sides, got {init.shape} and {resp.shape}")
    n = init.shape[0]
    if calib < 1 or calib + settle >= n:
        raise ValueError(f"need >= 1 calibration round and >= 1 measured round: calib={calib}, settle={settle}, n={n}")
    fwd = (resp[:, 0] - init[:, 0]).astype(np.float64)
    back = (init[:, 1] - resp[:, 1]).astype(np.float64)
    offs = (fwd[:calib] - back[:calib]) / 2.0
    off = float(np.median(offs))
    q1, q3 = np.percentile(offs, [25, 75])
    m = slice(calib + settle, n)
    rtt = (init[:, 1] - init[:, 0]).astype(np.float64)
    return OneWay(rtt=rtt[m], a_to_b=fwd[m] - off, b_to_a=back[m] + off, offset=off, offset_iqr=float(q3 - q1),
                  calib_rtt=rtt[:calib])


# ---------------------------------------------------------------------------- topology


def gpc_groups(clusters, sm_ids=None) -> dict[int, int]:
    """Union-find over SMs that were seen in one thread-block cluster (a cluster never spans
    GPCs). Returns {smid: group label}, labels 0.. in order of the smallest SM of each group.
    SMs in `sm_ids` never seen in a cluster get their own group."""
    parent: dict[int, int] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for c in clusters:
        c = [int(s) for s in c]
        for s in c:
            find(s)
        for s in c[1:]:
            ra, rb = find(c[0]), find(s)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    for s in (sm_ids or []):
        find(int(s))
    roots = sorted({find(s) for s in parent})
    label = {r: i for i, r in enumerate(roots)}
    return {s: label[find(s)] for s in sorted(parent)}


def compare_groups(a, b) -> dict:
    """Medians and a two-sided Mann-Whitney p-value of two latency samples (e.g. same-GPC vs
    cross-GPC pairs)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size < 2 or b.size < 2:
        return {"n_a": int(a.size), "n_b": int(b.size), "p_two_sided": None,
                "median_a": float(np.median(a)) if a.size else None, "median_b": float(np.median(b)) if b.size else None}
    _, p = mann_whitney(a, b, "two-sided")
    return {"n_a": int(a.size), "n_b": int(b.size), "median_a": float(np.median(a)), "median_b": float(np.median(b)),
            "ratio": float(np.median(a) / np.median(b)), "p_two_sided": p}


# ---------------------------------------------------------------------------- constants

FLAG_LATENCY_RULE = ("median over SM pairs of each pair's median one-way latency (round trip / 2) of a "
                     "release-store flag polled with ld.acquire.gpu, idle GPU, no back-off; spread: 90% "
                     "bootstrap interval of that median over pairs")


def flag_latency(per_pair_medians_s) -> tuple[float, tuple[float, float]]:
    x = np.asarray(per_pair_medians_s, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no SM pairs measured")
    return float(np.median(x)), bootstrap_ci(x)


BACKOFF_RULE = ("poll_backoff_ns = the largest nanosleep back-off (of those measured) whose median one-way "
                "flag latency, measured while every other SM also polls with that back-off, is within "
                "max(5%, the 90% bootstrap half-width) of the best back-off's median: back off only as far "
                "as it costs no measurable latency, since each probe is L2 traffic every waiter adds")


def choose_backoff(loaded: dict[int, np.ndarray], rel_tol: float = 0.05) -> tuple[int, dict]:
    """Apply BACKOFF_RULE. `loaded`: {backoff_ns: one-way latency samples}. Returns (backoff_ns,
    {backoff: median}) ."""
    if not loaded:
        raise ValueError("no back-off measured")
    med = {int(b): float(np.median(np.asarray(v, dtype=np.float64))) for b, v in loaded.items()}
    best_b = min(med, key=lambda b: (med[b], b))
    lo, hi = bootstrap_ci(loaded[best_b], n_boot=300)
    tol = max(rel_tol * med[best_b], (hi - lo) / 2.0)
    ok = [b for b in med if med[b] <= med[best_b] + tol]
    return max(ok), med


def choose_backoff_spread(loaded: dict[int, np.ndarray], n_boot: int = 100, seed: int = 0) -> tuple[int, int]:
    """(min, max) of the rule's choice over bootstrap resamples of every back-off's samples."""
    rng = np.random.default_rng(seed)
    picks = []
    for _ in range(n_boot):
        rs = {b: rng.choice(np.asarray(v), size=len(v)) for b, v in loaded.items()}
        med = {b: float(np.median(v)) for b, v in rs.items()}
        best = min(med, key=lambda b: (med[b], b))
        tol = 0.05 * med[best]
        picks.append(max(b for b in med if med[b] <= med[best] + tol))
    return int(min(picks)), int(max(picks))


SPIN_BOUND_RULE = ("spin_bound_ns = max(1 ms, 1000 x the 99.9th percentile of every wait observed in sync.flags "
                   "(all round trips: idle, loaded, backed-off, bulk copies in flight)), rounded up to the next "
                   "1-2-5 step (1, 2, 5, 10 ms, ...), so that the tail's run-to-run wobble (6.8 us p99.9 on "
                   "2026-11-29) does not move a constant the build renders. It bounds latency-bound waits; a wait on "
                   "a producer's long compute phase needs that phase's duration added")
SPIN_BOUND_FLOOR_NS = 1_000_000


def step_125(x: float) -> int:
    """The smallest value of the series 1, 2, 5, 10, 20, 50, ... that is >= x (x > 0)."""
    if not x > 0:
        raise ValueError(f"step_125 needs a positive number, got {x!r}")
    e = 10 ** math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if m * e >= x * (1 - 1e-12):
            return int(round(m * e))
    raise AssertionError("unreachable")


def spin_bound_ns(waits_s) -> tuple[int, tuple[int, int], float]:
    """Apply SPIN_BOUND_RULE; returns (bound_ns, bootstrap (lo, hi) of the bound, p99.9 in s)."""
    x = np.asarray(waits_s, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no waits observed")

    def rule(p999_s: float) -> int:
        return step_125(max(SPIN_BOUND_FLOOR_NS, 1000.0 * p999_s * 1e9))

    p = float(np.percentile(x, 99.9))
    lo, hi = bootstrap_ci(x, stat=lambda s: np.percentile(s, 99.9), n_boot=200)
    return rule(p), (rule(lo), rule(hi)), p


SENTINEL_RULE = ("sentinel_pays = 1 if, at every payload size up to {small} B, the sentinel scheme (fp32 slots, "
                 "double-buffered, reset + one fence per round) has a lower median one-way publish latency "
                 "than data + st.release flag in the ping-pong, with one-sided Mann-Whitney p < 0.01; else 0. "
                 "Spread: min and max of the decision over 200 bootstrap resamples (medians only)")


def sentinel_pays(sent: dict[int, np.ndarray], rel: dict[int, np.ndarray], small_max: int = 4096,
                  n_boot: int = 200, seed: int = 0) -> tuple[int, tuple[int, int], dict]:
    sizes = sorted(s for s in sent if s in rel and s <= small_max)
    if not sizes:
        raise ValueError("no common small payload sizes for the sentinel/flag comparison")
    per = {}
    ok = True
    for s in sizes:
        a = np.asarray(sent[s], dtype=np.float64)
        b = np.asarray(rel[s], dtype=np.float64)
        _, p = mann_whitney(a, b, "less")
        ratio = float(np.median(a) / np.median(b))
        per[s] = {"ratio": ratio, "p_less": p}
        ok &= ratio < 1.0 and p < 0.01
    rng = np.random.default_rng(seed)
    dec = []
    for _ in range(n_boot):
        d = all(np.median(rng.choice(np.asarray(sent[s]), len(sent[s]))) <
                np.median(rng.choice(np.asarray(rel[s]), len(rel[s]))) for s in sizes)
        dec.append(int(d))
    return int(ok), (min(dec), max(dec)), per


STOP_RULE = ("sync_stop_cost_s = median over the blocks of a persistent grid (one block per SM) of the time per "
             "stop of per-dependency flags with one producer per block (release-store own flag, acquire-poll the "
             "producer's), minus the median empty-loop time per stop; spread: 90% bootstrap interval over blocks")


def per_stop_seconds(cycles_per_block, stops: int, sm_mhz: float, baseline_s: float = 0.0) -> np.ndarray:
    if stops <= 0:
        raise ValueError("stops must be positive")
    c = np.asarray(cycles_per_block, dtype=np.float64)
    return c / stops / (sm_mhz * 1e6) - baseline_s


def percentiles(x, qs=(10, 50, 90, 99)) -> dict[str, float]:
    x = np.asarray(x, dtype=np.float64)
    return {f"p{q}": float(np.percentile(x, q)) for q in qs}
