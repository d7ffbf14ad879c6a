"""Profiler event registries of the clocks benchmarks. Their headers under gen/ are generated
(`python -m microbench.clocks.events`) and checked against these registries by a CPU test."""
from __future__ import annotations

import sys
from pathlib import Path

from .profiler import ProfileEvents

GEN_DIR = Path(__file__).resolve().parent / "gen"
REGENERATE = "python -m microbench.clocks.events"

# Instrumentation-cost kernel (instr.cu): a persistent kernel of PHASES streaming phases,
# each after a wait on its producer block's flag.
INSTR = ProfileEvents("clocks_instr", prefix="CLK_INSTR_EV",
                      doc="instr.cu: per-phase stamps of the instrumentation-cost kernel", regenerate=REGENERATE)
INSTR.phase("wait", "thread 0 polls the producer block's flag (arg = phase index)")
INSTR.phase("compute", "stream one slice through the phase's multiply-add (arg = phase index)")
INSTR.instant("mark", "extra stamps of the cost-versus-stamp-count slope (arg = phase index)")

# Launch-to-launch kernel (launch.cu): one block per SM, each block's landing, release and exit.
LAUNCH = ProfileEvents("clocks_launch", prefix="CLK_LAUNCH_EV",
                       doc="launch.cu: when each block of a chained persistent kernel lands, is released and exits",
                       regenerate=REGENERATE)
LAUNCH.phase("griddep_wait", "from the block's first instruction to griddepcontrol.wait returning")
LAUNCH.phase("work", "timed busy work after the release (arg = planned ns)")

# Stamp-cost loop (timers.cu).
TIMERS = ProfileEvents("clocks_timers", prefix="CLK_TIMERS_EV", doc="timers.cu: the stamp-cost loop", regenerate=REGENERATE)
TIMERS.instant("mark", "one stamp of the back-to-back stamp loop (arg = iteration)")

ALL_EVENTS = (INSTR, LAUNCH, TIMERS)


def header_path(ev: ProfileEvents) -> Path:
    return GEN_DIR / f"{ev.name}_events.cuh"


def main() -> int:
    """Regenerate the committed event headers under gen/ from the registries above."""
    for ev in ALL_EVENTS:
        print(ev.write_header(header_path(ev)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
