"""The persisting-L2 set-aside and access-policy window, applied for the length of a `with` block
and always undone: the GPU is left as it was found (set-aside limit restored, persisting lines
reset to normal, the stream's window cleared), and the restore is verified.

Driver API through cuda.bindings (torch exposes no access-policy window):
cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE), cuStreamSetAttribute(ACCESS_POLICY_WINDOW),
cuCtxResetPersistingL2Cache.
"""
from __future__ import annotations

from contextlib import contextmanager

from ..errors import MegabenchError


def _drv():
    from cuda.bindings import driver  # heavy: cuda

    return driver


def _ok(res, what: str):
    d = _drv()
    err, *vals = res if isinstance(res, tuple) else (res,)
    if err != d.CUresult.CUDA_SUCCESS:
        raise MegabenchError(f"{what} failed: {getattr(err, 'name', err)}")
    return vals[0] if len(vals) == 1 else vals


def window_value(base_ptr: int, num_bytes: int, hit_ratio: float = 1.0, persisting: bool = True):
    """A CUstreamAttrValue holding an access-policy window (num_bytes 0 = no window)."""
    if num_bytes < 0 or base_ptr < 0:
        raise ValueError(f"access-policy window base 0x{base_ptr:x} / size {num_bytes} must be non-negative")
    if not 0.0 <= hit_ratio <= 1.0:
        raise ValueError(f"hit_ratio {hit_ratio} must be in [0, 1]")
    d = _drv()
    v = d.CUstreamAttrValue()
    w = v.accessPolicyWindow
    w.base_ptr = int(base_ptr)
    w.num_bytes = int(num_bytes)
    w.hitRatio = float(hit_ratio)
    prop = d.CUaccessProperty
    w.hitProp = prop.CU_ACCESS_PROPERTY_PERSISTING if persisting else prop.CU_ACCESS_PROPERTY_NORMAL
    w.missProp = prop.CU_ACCESS_PROPERTY_STREAMING if persisting else prop.CU_ACCESS_PROPERTY_NORMAL
    v.accessPolicyWindow = w
    return v


def persisting_limit() -> int:
    d = _drv()
    return int(_ok(d.cuCtxGetLimit(d.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE), "cuCtxGetLimit(PERSISTING_L2)"))


def stream_window(stream_handle: int) -> tuple[int, int]:
    """(base_ptr, num_bytes) of the access-policy window currently set on a stream."""
    d = _drv()
    v = _ok(d.cuStreamGetAttribute(d.CUstream(stream_handle),
                                   d.CUstreamAttrID.CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW),
            "cuStreamGetAttribute(ACCESS_POLICY_WINDOW)")
    return int(v.accessPolicyWindow.base_ptr), int(v.accessPolicyWindow.num_bytes)


@contextmanager
def persisting_window(stream_handle: int, base_ptr: int, num_bytes: int, set_aside: int, max_set_aside: int,
                      hit_ratio: float = 1.0):
    """Inside the block, kernels on `stream_handle` touching [base, base+num_bytes) mark those lines
    persisting in an L2 set-aside of `set_aside` bytes. Undone (and checked) on exit, even on error."""
    if set_aside <= 0 or set_aside > max_set_aside:
        raise ValueError(f"persisting set-aside {set_aside} B must be in (0, {max_set_aside}] "
                         "(the device's MAX_PERSISTING_L2_CACHE_SIZE)")
    if num_bytes <= 0:
        raise ValueError("the access-policy window must cover at least one byte")
    d = _drv()
    lim = d.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE
    attr = d.CUstreamAttrID.CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
    stream = d.CUstream(stream_handle)
    old_limit = persisting_limit()
    old_window = stream_window(stream_handle)
    if old_window[1] != 0:
        raise MegabenchError(f"stream 0x{stream_handle:x} already has an access-policy window {old_window}; "
                             "refusing to overwrite someone else's setting")
    try:
        _ok(d.cuCtxSetLimit(lim, int(set_aside)), f"cuCtxSetLimit(PERSISTING_L2, {set_aside})")
        _ok(d.cuStreamSetAttribute(stream, attr, window_value(base_ptr, num_bytes, hit_ratio)),
            "cuStreamSetAttribute(ACCESS_POLICY_WINDOW)")
        yield {"set_aside": int(set_aside), "old_limit": old_limit, "granted_limit": persisting_limit()}
    finally:
        import torch  # heavy: torch

        torch.cuda.synchronize()  # the window's kernels must be done before the lines are reset
        _ok(d.cuStreamSetAttribute(stream, attr, window_value(0, 0, 0.0, persisting=False)),
            "cuStreamSetAttribute(ACCESS_POLICY_WINDOW, cleared)")
        _ok(d.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")
        _ok(d.cuCtxSetLimit(lim, old_limit), f"cuCtxSetLimit(PERSISTING_L2, {old_limit}) (restore)")
        now_limit, now_window = persisting_limit(), stream_window(stream_handle)
        if now_limit != old_limit or now_window[1] != 0:
            raise MegabenchError(f"persisting-L2 state not restored: limit {now_limit} (was {old_limit}), "
                                 f"window {now_window}")
