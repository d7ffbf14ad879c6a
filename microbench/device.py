"""Device facts: what the GPU is, what it allows, and what its clocks are doing right now.

Read from the driver (cuda.bindings) and NVML; nothing here is a datasheet constant. On a
machine without a GPU every query raises NoGPUError with the reason, and `gpu_count()` is 0.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from .errors import NoGPUError, UnsupportedArchError

# Targets this project's kernels are written for: Hopper (wgmma, bulk copies, clusters) and
# Blackwell datacenter parts, which run sm_90 code through their own 'a'-less targets.
_ARCH_FOR_CC = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
MIN_CC = (9, 0)


def _drv():
    from cuda.bindings import driver  # heavy: cuda

    return driver


def _check(res, what: str):
    """Unwrap a cuda.bindings (err, *values) tuple; raise NoGPUError on failure."""
    err, *vals = res
    drv = _drv()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise NoGPUError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return vals[0] if len(vals) == 1 else vals


@functools.lru_cache(maxsize=1)
def _init_error() -> str | None:
    """None when the driver initialised, else the reason (cached: cuInit is process-global)."""
    try:
        drv = _drv()
    except Exception as e:  # cuda-bindings missing or its native lib unloadable
        return f"cuda.bindings is unusable: {e}"
    try:
        (err,) = drv.cuInit(0)
    except Exception as e:  # libcuda.so absent: a machine without the NVIDIA driver
        return f"no NVIDIA driver ({e.__class__.__name__}: {e})"
    if err != drv.CUresult.CUDA_SUCCESS:
        return f"cuInit failed with {err.name}"
    return None


def gpu_count() -> int:
    """Number of visible CUDA devices; 0 (never an exception) when there is no usable driver."""
    if _init_error() is not None:
        return 0
    drv = _drv()
    err, n = drv.cuDeviceGetCount()
    return int(n) if err == drv.CUresult.CUDA_SUCCESS else 0


def no_gpu_reason() -> str | None:
    """Why there is no GPU, or None when there is one."""
    reason = _init_error()
    if reason is None and gpu_count() == 0:
        reason = "the driver sees 0 devices (CUDA_VISIBLE_DEVICES=%r)" % os.environ.get("CUDA_VISIBLE_DEVICES")
    return reason


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    uuid: str
    cc: tuple[int, int]
    arch: str  # the NVRTC target this project compiles for on this device
    sm_count: int
    l2_bytes: int
    persisting_l2_max_bytes: int
    smem_per_block_optin: int
    smem_per_sm: int
    reserved_smem_per_block: int
    max_threads_per_sm: int
    regs_per_sm: int
    total_mem_bytes: int
    mem_bus_width_bits: int
    sm_clock_max_mhz: int  # NVML max SM clock (boost); 0 if NVML is unavailable
    mem_clock_max_mhz: int
    driver_version: str  # e.g. "580.159.04" from NVML, else the CUDA driver API number
    cuda_driver_version: int  # e.g. 13000

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _attr(dev, name: str) -> int:
    drv = _drv()
    return int(_check(drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), dev), name))


@functools.lru_cache(maxsize=None)
def device_info(index: int = 0) -> DeviceInfo:
    """Facts about device `index`. Raises NoGPUError without one."""
    reason = no_gpu_reason()
    if reason is not None:
        raise NoGPUError(f"no CUDA GPU: {reason}. This command needs a GPU; "
                         "CPU-only work (compile checks, reports, gates) runs without one.")
    drv = _drv()
    if index >= gpu_count():
        raise NoGPUError(f"device {index} requested but only {gpu_count()} visible")
    dev = _check(drv.cuDeviceGet(index), "cuDeviceGet")
    name = _check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = name.split(b"\0", 1)[0].decode()
    uuid = _check(drv.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    uuid_s = bytes(uuid.bytes).hex() if hasattr(uuid, "bytes") else str(uuid)
    cc = (_attr(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
          _attr(dev, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"))
    total = int(_check(drv.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))
    drv_ver = int(_check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    nv = _nvml_static(index)
    return DeviceInfo(
        index=index,
        name=name,
        uuid=uuid_s,
        cc=cc,
        arch=_ARCH_FOR_CC.get(cc, f"sm_{cc[0]}{cc[1]}"),
        sm_count=_attr(dev, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        l2_bytes=_attr(dev, "CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
        persisting_l2_max_bytes=_attr(dev, "CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE"),
        smem_per_block_optin=_attr(dev, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        smem_per_sm=_attr(dev, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
        reserved_smem_per_block=_attr(dev, "CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK"),
        max_threads_per_sm=_attr(dev, "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR"),
        regs_per_sm=_attr(dev, "CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR"),
        total_mem_bytes=total,
        mem_bus_width_bits=_attr(dev, "CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH"),
        sm_clock_max_mhz=nv.get("sm_max", 0),
        mem_clock_max_mhz=nv.get("mem_max", 0),
        driver_version=nv.get("driver", str(drv_ver)),
        cuda_driver_version=drv_ver,
    )


def require_gpu(index: int = 0, min_cc: tuple[int, int] = MIN_CC) -> DeviceInfo:
    """DeviceInfo for a device this project's kernels support, or a clear error."""
    info = device_info(index)
    if info.cc < min_cc:
        raise UnsupportedArchError(
            f"{info.name} is compute capability {info.cc[0]}.{info.cc[1]}; these kernels need "
            f">= {min_cc[0]}.{min_cc[1]} (Hopper: bulk copies, mbarriers, clusters, %globaltimer semantics)")
    return info


# ----------------------------------------------------------------------------- NVML clocks
@functools.lru_cache(maxsize=None)
def _nvml_handle(index: int):
    try:
        import pynvml  # heavy: pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None, None


def _nvml_static(index: int) -> dict:
    nv, h = _nvml_handle(index)
    if h is None:
        return {}
    out = {}
    try:
        out["sm_max"] = int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))
        out["mem_max"] = int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM))
        d = nv.nvmlSystemGetDriverVersion()
        out["driver"] = d.decode() if isinstance(d, bytes) else str(d)
    except Exception:
        pass
    return out


@dataclass(frozen=True)
class ClockReading:
    """SM/memory clocks at one instant (NVML). 0 means NVML could not be read."""

    sm_mhz: int
    mem_mhz: int
    sm_max_mhz: int
    throttle_reasons: int = 0

    @property
    def fraction_of_max(self) -> float:
        return self.sm_mhz / self.sm_max_mhz if self.sm_max_mhz else float("nan")


def read_clocks(index: int = 0) -> ClockReading:
    nv, h = _nvml_handle(index)
    if h is None:
        return ClockReading(0, 0, 0)
    try:
        reasons = 0
        try:
            reasons = int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))
        except Exception:
            pass
        return ClockReading(
            sm_mhz=int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            mem_mhz=int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
            sm_max_mhz=int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
            throttle_reasons=reasons,
        )
    except Exception:
        return ClockReading(0, 0, 0)
