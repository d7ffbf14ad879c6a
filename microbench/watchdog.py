"""Host side of the bounded spin-waits in microbench/cuda/mb/spin.cuh
(layout: microbench/cuda/mb/watchdog.cuh).

The record layout is parsed from the header's WD_* enum (the single source), a zeroed record is
passed to the kernel, and `check()` raises SpinTimeoutError naming what a wait gave up on.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path

from .errors import SpinTimeoutError

HEADER = Path(__file__).resolve().parent / "cuda" / "mb" / "watchdog.cuh"


@functools.lru_cache(maxsize=1)
def fields() -> dict[str, int]:
    text = HEADER.read_text()
    body = text[text.index("enum WatchdogField"):]
    body = body[:body.index("};")]
    out = {m.group(1): int(m.group(2)) for m in re.finditer(r"WD_([A-Z_]+)\s*=\s*(\d+)", body)}
    if "FIELDS" not in out:
        raise RuntimeError(f"{HEADER}: WD_FIELDS missing from the WatchdogField enum")
    return out


class Watchdog:
    """A zeroed record on the GPU plus the bound; pass `.ptr` and `.bound_ns` to the kernel."""

    def __init__(self, bound_ns: int, device: str = "cuda"):
        import torch  # heavy: torch

        self.bound_ns = int(bound_ns)
        self.rec = torch.zeros(fields()["FIELDS"], dtype=torch.int64, device=device)

    @property
    def ptr(self) -> int:
        return self.rec.data_ptr()

    def reset(self) -> None:
        self.rec.zero_()

    def check(self, describe_what: Callable[[int], str] | None = None, context: str = "kernel") -> None:
        """Raise SpinTimeoutError if any wait gave up (synchronises with the device)."""
        rec = self.rec.cpu().tolist()
        f = fields()
        if rec[f["TRIPPED"]] == 0:
            return
        what = rec[f["WHAT"]]
        desc = describe_what(what) if describe_what else f"wait id {what}"
        raise SpinTimeoutError(
            f"{context}: block {rec[f['BLOCK']]} thread {rec[f['THREAD']]} gave up waiting for {desc} "
            f"at 0x{rec[f['ADDR']] & (2**64 - 1):x}: expected {rec[f['EXPECTED']]}, last saw {rec[f['SEEN']]} "
            f"after {rec[f['ELAPSED_NS']] / 1e3:.1f} us (bound {self.bound_ns / 1e3:.1f} us)")
