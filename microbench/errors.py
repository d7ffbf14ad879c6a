"""Errors megabench raises on bad input. Each names the problem and what to do about it."""
from __future__ import annotations


class MegabenchError(Exception):
    """Base class: anything the user can act on."""


class NoGPUError(MegabenchError):
    """No usable CUDA device (no driver, no device, or CUDA_VISIBLE_DEVICES hides it)."""


class UnsupportedArchError(MegabenchError):
    """The device or requested target architecture is not one this code was written for."""


class CompileError(MegabenchError):
    """NVRTC / nvJitLink rejected a source; the message carries the compiler log."""


class KernelDoesNotFitError(MegabenchError):
    """A launch asks for more than the device gives (co-residency, smem, registers, code budget)."""


class DeviceMemoryError(MegabenchError):
    """What a run would allocate does not fit the GPU's free memory (named before allocating it)."""


class GpuTooSmallError(DeviceMemoryError):
    """What a run needs exceeds the GPU's total memory less the model's own weights: it can never
    run on this GPU, whatever else is freed (a GPU test skips on it, naming the bytes)."""


class ResultsFileError(MegabenchError):
    """A results or constants file is malformed, of an unknown/future schema, or incompatible."""


class SpinTimeoutError(MegabenchError):
    """A bounded spin-wait on the GPU gave up; the message says what it waited for."""


class CorrectnessError(MegabenchError):
    """A kernel's output did not match its reference; timing is refused."""


class OutputError(MegabenchError):
    """An output cannot be written where asked: its folder does not exist, or it names something that
    must not be replaced. Nothing was written."""
