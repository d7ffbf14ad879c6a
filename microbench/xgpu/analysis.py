"""Pure analysis of the cross-GPU stamps (no GPU needed; tests/test_xgpu_analysis.py).

Clock model: each GPU's %globaltimer reads true time + offset_g (+ drift over seconds). Offsets
come from symmetric exchanges: a request stamped t0 and t1 by the asker, answered at s by the
other side, gives offset(other - asker) = s - (t0 + t1) / 2 with error at most (t1 - t0) / 2.
Only the fastest exchanges are kept (their error bound is smallest and queueing makes the two
trips least unequal).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sync.sentinel import BF16, F32

OFFSET_RULE = ("offset = mean over the fastest {keep:.0%} of exchanges of s - (t0 + t1) / 2 (s: the other side's "
               "stamp, t0/t1: the asker's send and receive; the mean, not the median, because stamps are quantised to "
               "the timer's step and varied delays dither them); error bound: half the kept exchanges' median round "
               "trip")
KEEP = 0.5  # share of exchanges (the fastest) an offset is estimated from
DRIFT_RULE = "drift = (offset at end - offset at start) / host seconds between the two measurements"
SPREAD_RULE = ("per stop: latest minus earliest time at which a GPU's last block arrived, stamps mapped to rank 0's "
               "%globaltimer with the measured offsets")


@dataclass(frozen=True)
class Offset:
    offset_ns: float  # the other clock minus the asker's
    error_ns: float  # half the median round trip of the kept exchanges (bound on the asymmetry error)
    rtt_ns: float  # median round trip of all exchanges
    iqr_ns: float  # interquartile range of the kept exchanges' offsets
    kept: int
    total: int
    step_ns: int  # the timer's step seen in these stamps (timer_step_ns)


def timer_step_ns(*stamps) -> int:
    """The step a timer's readings move in: the gcd of all differences between the stamps (0 when
    they are all equal). %globaltimer advances in whole steps (32 ns on one H200, coarser on
    others), so offsets and spreads below a few steps are not resolved."""
    x = np.unique(np.concatenate([np.asarray(s, dtype=np.int64).ravel() for s in stamps]))
    d = np.diff(x)
    return int(np.gcd.reduce(d)) if d.size else 0


def exchange_offset(t0, t1, s, keep: float = KEEP) -> Offset:
    """Offset of the answering clock against the asking clock from exchanges (t0, s, t1)."""
    t0 = np.asarray(t0, dtype=np.float64)
    t1 = np.asarray(t1, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    if not (t0.shape == t1.shape == s.shape) or t0.ndim != 1 or t0.size < 4:
        raise ValueError(f"need >= 4 exchanges of matching shape, got {t0.shape}, {t1.shape}, {s.shape}")
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    rtt = t1 - t0
    if (rtt < 0).any():
        raise ValueError("an exchange ended before it began (t1 < t0)")
    k = max(2, int(np.ceil(keep * rtt.size)))
    idx = np.argsort(rtt, kind="stable")[:k]
    offs = s[idx] - (t0[idx] + t1[idx]) / 2.0
    q1, q3 = np.percentile(offs, [25, 75])
    return Offset(float(np.mean(offs)), float(np.median(rtt[idx]) / 2.0), float(np.median(rtt)), float(q3 - q1),
                  int(k), int(rtt.size), timer_step_ns(t0, t1, s))


def drift_ppm(off_start_ns: float, off_end_ns: float, host_seconds: float) -> float:
    """Relative rate difference of two clocks (parts per million) from two offsets."""
    if host_seconds <= 0:
        raise ValueError(f"drift needs a positive interval, got {host_seconds} s")
    return (off_end_ns - off_start_ns) / (host_seconds * 1e9) * 1e6


def one_way_ns(init_stamps, mhz: float) -> np.ndarray:
    """Round trips (receive - send, %clock64 of the initiator) / 2, in ns at `mhz`."""
    a = np.asarray(init_stamps, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] != 2:
        raise ValueError(f"initiator stamps must be [rounds, 2], got {a.shape}")
    if mhz <= 0:
        raise ValueError("converting cycles needs the initiator's SM clock in MHz")
    return (a[:, 1] - a[:, 0]) / 2.0 / (mhz * 1e-3)


def to_common(stamps_ns, offset_ns: float) -> np.ndarray:
    """A GPU's %globaltimer stamps on rank 0's time base (offset_ns = this GPU's clock minus rank 0's)."""
    return np.asarray(stamps_ns, dtype=np.float64) - float(offset_ns)


@dataclass(frozen=True)
class Stops:
    gpu_spread_ns: np.ndarray  # [stops] latest minus earliest GPU arrival (a GPU arrives with its last block)
    block_spread_ns: np.ndarray  # [stops] latest minus earliest block arrival over every GPU
    wait_ns: np.ndarray  # [ranks, stops] from a GPU's arrival until it had seen every GPU's flag
    local_spread_ns: np.ndarray  # [ranks, stops] latest minus earliest block arrival within a GPU
    slowest: np.ndarray  # [stops] rank whose arrival was last


def stops(arrive, gpu, offsets_ns) -> Stops:
    """arrive: [ranks][stops][blocks] block arrival stamps; gpu: [ranks][stops][2] block 0's (all
    local blocks arrived, every GPU's flag seen); offsets_ns[r]: rank r's clock minus rank 0's."""
    a = np.asarray(arrive, dtype=np.float64)
    g = np.asarray(gpu, dtype=np.float64)
    off = np.asarray(offsets_ns, dtype=np.float64)
    if a.ndim != 3 or g.shape != a.shape[:2] + (2,) or off.shape != (a.shape[0],):
        raise ValueError(f"shapes: arrive {a.shape}, gpu {g.shape}, offsets {off.shape}")
    a = a - off[:, None, None]
    g = g - off[:, None, None]
    last = a.max(axis=2)  # [ranks, stops]
    return Stops(gpu_spread_ns=last.max(axis=0) - last.min(axis=0),
                 block_spread_ns=a.max(axis=(0, 2)) - a.min(axis=(0, 2)),
                 wait_ns=g[:, :, 1] - g[:, :, 0],
                 local_spread_ns=a.max(axis=2) - a.min(axis=2),
                 slowest=np.argmax(last, axis=0))


# ------------------------------------------------------------------ collective references
def allreduce_reference(payloads) -> np.ndarray:
    """What every rank's sentinel all-reduce must hold, bit for bit: each rank's fp32 words
    canonicalised by the slot rule (-0.0 -> +0.0), added in rank order 0..N-1 in fp32."""
    p = np.asarray(payloads, dtype=np.uint32)
    if p.ndim < 2:
        raise ValueError("payloads: [ranks, ...] fp32 words")
    enc = F32.encode(p).view(np.float32)
    acc = enc[0].copy()
    for r in range(1, p.shape[0]):
        acc = (acc + enc[r]).astype(np.float32)
    return acc.view(np.uint32)


def allgather_reference(payloads) -> np.ndarray:
    """[ranks, ...] bf16 patterns as every rank's gather must hold them (0xFFFF -> 0x7FC0)."""
    return BF16.encode(np.asarray(payloads, dtype=np.uint16))


def collective_expected(op: str, payloads, received) -> tuple[np.ndarray, np.ndarray]:
    """(expected, got) element arrays of a verify launch: payloads [ranks, rounds, bytes] (uint8, as
    each rank sent them), received: one rank's output bytes. all-reduce: [rounds, words] fp32 bit
    patterns; all-gather: [rounds, ranks, elements] bf16 patterns."""
    p = np.asarray(payloads, dtype=np.uint8)
    ranks, rounds = p.shape[:2]
    got = np.asarray(received, dtype=np.uint8)
    if op == "allreduce":
        ref = np.stack([allreduce_reference(p[:, j].view(np.uint32)) for j in range(rounds)])
        return ref, got.view(np.uint32).reshape(rounds, -1)
    if op == "allgather":
        ref = np.stack([allgather_reference(p[:, j].view(np.uint16)) for j in range(rounds)])
        return ref, got.view(np.uint16).reshape(rounds, ranks, -1)
    raise ValueError(f"unknown collective {op!r}")


def finite_f32_payload(rng, n: int) -> np.ndarray:
    """fp32 words for the all-reduce check: normal values over many exponents, exact zeros of
    both signs (-0.0 is the slot's sentinel), subnormals. No NaN or infinity: NaN payloads after an
    addition are not specified bit-for-bit (the GPU returns its canonical NaN)."""
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32).view(np.uint32)
    cls = rng.integers(0, 10, n)
    x = np.where(cls == 0, np.uint32(0x80000000), x)  # -0.0
    x = np.where(cls == 1, np.uint32(0x00000000), x)
    sub = (rng.integers(1, 1 << 23, n).astype(np.uint32) | (rng.integers(0, 2, n).astype(np.uint32) << 31))
    return np.where(cls == 2, sub, x).astype(np.uint32)


def nccl_differences(ours_u32, nccl_u32, payloads) -> dict:
    """Compare the sentinel all-reduce with NCCL's: where they differ, say whether the slot rule
    explains it (every input of the element was a zero, at least one -0.0: the rule adds +0.0)."""
    o = np.asarray(ours_u32, dtype=np.uint32)
    c = np.asarray(nccl_u32, dtype=np.uint32)
    p = np.asarray(payloads, dtype=np.uint32)
    diff = o != c
    zero_only = ((p & np.uint32(0x7FFFFFFF)) == 0).all(axis=0)
    explained = diff & zero_only & (o == 0) & (c == np.uint32(0x80000000))
    of = o.view(np.float32)
    cf = c.view(np.float32)
    other = diff & ~explained
    rel = np.abs(of[other] - cf[other]) / np.maximum(np.abs(cf[other]), np.float32(1e-30)) if other.any() else np.zeros(0)
    return {"elements": int(o.size), "differ": int(diff.sum()), "differ_by_slot_rule": int(explained.sum()),
            "differ_otherwise": int(other.sum()), "max_rel_otherwise": float(rel.max()) if rel.size else 0.0}
