"""A second, independent writer of profiler buffers for CPU tests: it follows the record and
buffer layout of microbench/cuda/mb/profile.cuh (through its parsed ProfLayout enum) exactly as
Profiler::stamp does, so decode() is tested against the device's rules, not against itself.
The GPU test checks the real device writes what this writes."""
from __future__ import annotations

import numpy as np

from microbench.clocks.profiler import ProfileLayout, layout_constants


def emulate(layout: ProfileLayout, stamps: dict, launches: int = 1, epoch: int = 1,
            buf: np.ndarray | None = None) -> np.ndarray:
    """stamps: {(launch, block, warp): [(event, arg, gt, c64, sm), ...]} in program order; every
    key is a recording warp that built its Profiler (an empty list: one that stamped nothing)."""
    c = layout_constants()
    sw = layout.slice_bytes // 4
    if buf is None:
        buf = np.zeros(launches * sw, dtype=np.uint32)
        for L in range(launches):
            buf[L * sw: L * sw + c["HEADER_BYTES"] // 4] = layout.header_words(L, epoch)
    W, C = layout.warps, layout.cap
    for (L, b, w), recs in stamps.items():
        base = L * sw
        ovf = base + c["HEADER_BYTES"] // 4 + b * W + w
        rec0 = base + layout.records_offset // 4 + (b * W + w) * C * c["RECORD_WORDS"]
        buf[ovf] = 0  # the Profiler's construction resets its counter ...
        if b == 0 and w == 0:
            buf[base + c["H_EPOCH"]] = epoch  # ... and block 0's warp 0 the slice's header epoch
        for n, (ev, arg, gt, c64, sm) in enumerate(recs):
            if n < C:
                r = rec0 + n * c["RECORD_WORDS"]
                buf[r + c["W_TAG"]] = c["VALID"] | (w << c["TAG_WARP_SHIFT"]) | (ev & c["EVENT_MASK"])
                buf[r + c["W_ARG"]] = arg & 0xFFFFFFFF
                buf[r + c["W_GT_LO"]] = gt & 0xFFFFFFFF
                buf[r + c["W_GT_HI"]] = gt >> 32
                buf[r + c["W_CLK_LO"]] = c64 & 0xFFFFFFFF
                buf[r + c["W_CLK_HI"]] = c64 >> 32
                buf[r + c["W_SM"]] = sm
                buf[r + c["W_EPOCH_BLOCK"]] = (epoch << c["EPOCH_BLOCK_SHIFT"]) | (b & c["BLOCK_LOW_MASK"])
            else:
                buf[ovf] = n + 1 - C
    return buf
