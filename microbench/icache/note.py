"""The instruction-cache note: levels, miss costs, spliced-block ratios, the launch prefetch window
and the code-vs-data slowdown, read from the latest saved results (never typed in), each with
the GPU and date it was measured on. `python -m microbench.icache.note [--root DIR]` prints
markdown; a missing result or constant is said to be missing. The study's own (GB300) figures
are not repeated here: the report shows them separately, labelled with their hardware."""
from __future__ import annotations

from pathlib import Path

from .. import notes

KiB = 1024
ROWS = (  # (benchmark, derived key, label, scale, unit shown)
    ("icache.capacity", "icache_l0_bytes", "innermost instruction cache (L0, per sub-partition; capacity)", 1 / KiB,
     "KiB"),
    ("icache.capacity", "icache_sm_bytes", "the SM's instruction cache (the study's ~128 KB level; capacity)", 1 / KiB,
     "KiB"),
    ("icache.capacity", "icache_l0_miss_cpi_w1", "cost of missing the L0, 1 warp/SM", 1, "cycles/instr"),
    ("icache.capacity", "icache_sm_miss_cpi_w1", "cost of missing the SM's instruction cache (from L2), 1 warp/SM", 1,
     "cycles/instr"),
    ("icache.spliced", "spliced_ratio_w12_100K_100K", "100 KiB + 100 KiB spliced / alone, 12 warps/SM", 1, "x"),
    ("icache.spliced", "spliced_ratio_w12_100K_20K", "100 KiB + 20 KiB spliced / alone, 12 warps/SM", 1, "x"),
    ("icache.spliced", "spliced_ratio_w1_100K_100K", "100 KiB + 100 KiB spliced / alone, 1 warp/SM", 1, "x"),
    ("icache.spliced", "spliced_ratio_w1_100K_20K", "100 KiB + 20 KiB spliced / alone, 1 warp/SM", 1, "x"),
    ("icache.spliced", "spliced_block_a_ratio_w12_100K_20K", "the 100 KiB block spliced with 20 KiB / alone, "
     "12 warps/SM", 1, "x"),
    ("icache.spliced", "max_code_bytes_per_launch", "largest splice whose large block keeps its solo speed", 1 / KiB,
     "KiB"),
    ("icache.prefetch", "launch_prefetch_bytes", "launch prefetch window (icache-cold first pass)", 1 / KiB, "KiB"),
    ("icache.prefetch", "launch_prefetch_bytes_l2_cold", "same, L2-cold", 1 / KiB, "KiB"),
    ("icache.prefetch", "first_pass_ratio_icache_cold_vs_warm", "first pass, icache-cold / warm", 1, "x"),
    ("icache.code_vs_data", "icache_overflow_stream_slowdown", "weights stream: overflowing / fitting code", 1, "x"),
)


def render(root: Path | None = None) -> str:
    return notes.render("Instruction cache", ROWS, root)


def main(argv=None) -> int:
    return notes.main(__doc__, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
