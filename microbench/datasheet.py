"""Vendor datasheet figures, used only as labelled context beside measured bounds.

Measured ceilings (microbench/basics, microbench/weights) are the bounds benchmarks are judged
against; these numbers appear next to them so a reader sees how far the measured ceiling sits
from the advertised one. Source: NVIDIA H200 / H100 product datasheets (HBM bandwidth).
"""
from __future__ import annotations

HBM_BYTES_PER_S = {
    "NVIDIA H200": 4.8e12,  # H200 SXM, HBM3e (NVIDIA H200 Tensor Core GPU datasheet)
    "NVIDIA H100 80GB HBM3": 3.35e12,  # H100 SXM5 (NVIDIA H100 datasheet)
    "NVIDIA GB300": 8.0e12,  # Blackwell Ultra, HBM3e (NVIDIA GB300 NVL72 datasheet, per GPU)
}


def hbm_peak(gpu_name: str | None) -> float | None:
    if not gpu_name:
        return None
    for k, v in HBM_BYTES_PER_S.items():
        if gpu_name.startswith(k):
            return v
    return None
