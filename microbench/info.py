"""`megabench info`: the device's facts and clocks and the toolchain's versions, as text."""
from __future__ import annotations

from .compiler import toolchain_versions
from .device import device_info, gpu_count, no_gpu_reason, read_clocks


def describe() -> str:
    """Human-readable summary for `megabench info`."""
    lines = []
    reason = no_gpu_reason()
    if reason is not None:
        lines.append(f"GPU: none ({reason})")
        lines.append("  Needs a GPU: microbenchmarks, megakernel runs, GPU tests. "
                     "Works without: compile/resource checks, CPU tests, report, gate.")
    else:
        for i in range(gpu_count()):
            d = device_info(i)
            c = read_clocks(i)
            lines += [
                f"GPU {i}: {d.name} (cc {d.cc[0]}.{d.cc[1]}, target {d.arch})",
                f"  SMs {d.sm_count}, L2 {d.l2_bytes} B ({d.l2_bytes / 2**20:.1f} MiB), "
                f"persisting-L2 max {d.persisting_l2_max_bytes} B",
                f"  smem/block opt-in {d.smem_per_block_optin} B, smem/SM {d.smem_per_sm} B, "
                f"regs/SM {d.regs_per_sm}, memory {d.total_mem_bytes / 2**30:.1f} GiB, "
                f"bus {d.mem_bus_width_bits} bit",
                f"  clocks now: SM {c.sm_mhz} MHz (max {d.sm_clock_max_mhz}), memory {c.mem_mhz} MHz "
                f"(max {d.mem_clock_max_mhz})",
                f"  driver {d.driver_version} (CUDA {d.cuda_driver_version // 1000}.{d.cuda_driver_version % 1000 // 10})",
            ]
    tv = toolchain_versions()
    lines.append("Toolchain: " + ", ".join(f"{k} {v}" for k, v in tv.items()))
    return "\n".join(lines)
