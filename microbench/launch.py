"""Launching compiled kernels on torch's stream, and refusing launches that cannot work.

A persistent kernel whose blocks cannot all be resident at once deadlocks the moment one block
spins on a flag that an unscheduled block would set, so `check_coresident` runs before every
persistent launch and raises KernelDoesNotFitError instead.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .device import device_info, require_gpu
from .errors import KernelDoesNotFitError, NoGPUError

DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in (cuKernelSetAttribute)


def ensure_context(index: int | None = None):
    """Make device `index` current for cuda.core, sharing torch's primary context. Without an
    index: the device torch already works on (0 before torch's CUDA starts), so a process that
    drives GPU 1 (one process per GPU) is not switched back to GPU 0 by a later lookup."""
    if index is None:
        import torch  # heavy: torch

        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    return _ensure_context(index)


@functools.lru_cache(maxsize=None)
def _ensure_context(index: int):
    require_gpu(index)
    import torch  # heavy: torch

    torch.cuda.init()
    torch.cuda.set_device(index)
    from cuda.core import Device  # heavy: cuda

    dev = Device(index)
    dev.set_current()
    return dev


def device(index: int = 0):
    return ensure_context(index)


_STREAMS: dict[int, object] = {}


def current_stream():
    """torch's current stream as a cuda.core Stream (cached by handle)."""
    import torch  # heavy: torch

    ts = torch.cuda.current_stream()
    key = ts.cuda_stream
    if key not in _STREAMS:
        _STREAMS[key] = device(ts.device.index or 0).create_stream(ts)
    return _STREAMS[key]


@dataclass(frozen=True)
class LaunchSpec:
    grid: int | tuple[int, ...]
    block: int | tuple[int, ...]
    smem: int = 0
    cluster: int | tuple[int, ...] | None = None  # with a cluster, `grid` counts clusters
    cooperative: bool = False
    pdl: bool = False  # programmatic dependent launch (may overlap the previous kernel's tail)

    @property
    def threads(self) -> int:
        return _prod(self.block)

    @property
    def blocks(self) -> int:
        return _prod(self.grid) * (_prod(self.cluster) if self.cluster else 1)

    def config(self):
        from cuda.core import LaunchConfig  # heavy: cuda

        kw = dict(grid=self.grid, block=self.block, shmem_size=self.smem)
        if self.cluster:
            kw["cluster"] = self.cluster
        if self.cooperative:
            kw["is_cooperative"] = True
        if self.pdl:
            kw["programmatic_stream_serialization"] = True
        return LaunchConfig(**kw)


def _prod(x) -> int:
    if isinstance(x, int):
        return x
    p = 1
    for v in x:
        p *= v
    return p


def set_max_dynamic_smem(kernel, nbytes: int, index: int = 0) -> None:
    """Opt a kernel into `nbytes` of dynamic shared memory (needed above 48 KB)."""
    from cuda.bindings import driver  # heavy: cuda

    info = device_info(index)
    if nbytes > info.smem_per_block_optin:
        raise KernelDoesNotFitError(f"{nbytes} B dynamic smem requested; {info.name} allows "
                                    f"{info.smem_per_block_optin} B per block")
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = kernel.handle
    err, dev = driver.cuDeviceGet(index)
    (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, dev)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise KernelDoesNotFitError(f"cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes}) failed: {err.name}")


def max_resident_blocks(kernel, spec: LaunchSpec, index: int = 0) -> int:
    """How many blocks of this kernel/launch fit on the whole GPU at once."""
    info = device_info(index)
    if spec.cluster:
        clusters = kernel.occupancy.max_active_clusters(spec.config(), stream=current_stream())
        return int(clusters) * _prod(spec.cluster)
    per_sm = kernel.occupancy.max_active_blocks_per_multiprocessor(spec.threads, spec.smem)
    return int(per_sm) * info.sm_count


def check_coresident(kernel, spec: LaunchSpec, index: int = 0, what: str = "persistent kernel") -> int:
    """Raise KernelDoesNotFitError unless every block of `spec` can be resident at once."""
    fit = max_resident_blocks(kernel, spec, index)
    if spec.blocks > fit:
        a = kernel.attributes
        raise KernelDoesNotFitError(
            f"{what}: {spec.blocks} blocks of {spec.threads} threads with {spec.smem} B dynamic smem "
            f"(+{a.shared_size_bytes} B static, {a.num_regs} regs/thread"
            f"{', clusters of ' + str(spec.cluster) if spec.cluster else ''}) cannot all be resident: "
            f"the device holds {fit}. Blocks spinning on flags of unscheduled blocks would deadlock.")
    return fit


def _arg(a):
    if hasattr(a, "data_ptr"):
        return a.data_ptr()
    if isinstance(a, float):
        raise TypeError("pass np.float32/np.float64 explicitly: a Python float becomes a double")
    return a


_CHECKED: dict = {}


def launch(kernel, spec: LaunchSpec, *args, stream=None, persistent: bool = False) -> None:
    """Launch on torch's current stream. Tensors become pointers; ints are 64-bit unless np-typed."""
    from cuda.core import launch as _launch  # heavy: cuda

    # Keyed by the kernel object itself (kept alive by the dict): an id() or a driver handle of a
    # freed kernel can be reused by a new one, which would then skip its smem opt-in.
    # The opt-in is per device: a process driving GPU 1 (one process per GPU) must set it there.
    import torch  # heavy: torch

    index = torch.cuda.current_device()
    key = (kernel, spec, index)
    if key not in _CHECKED:
        if spec.smem > DEFAULT_SMEM_LIMIT:
            set_max_dynamic_smem(kernel, spec.smem, index)
        if persistent or spec.cooperative:
            check_coresident(kernel, spec, index)
        _CHECKED[key] = True
    try:
        _launch(stream or current_stream(), spec.config(), kernel, *[_arg(a) for a in args])
    except NoGPUError:
        raise
    except Exception as e:
        raise RuntimeError(f"launch of {kernel!r} with {spec} failed: {e}") from e
