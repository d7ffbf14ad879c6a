"""Leaving a process that has used CUDA through torch and cuda.core."""
from __future__ import annotations

import os
import sys


def leave(code: int) -> None:
    """Exit without running finalizers, once every result is saved and printed. Danger: tearing
    down torch.compile's graphs, CUDA graphs, cuda.core modules and torch's caching allocator in
    interpreter-exit order can abort the process ("double free or corruption", "free(): invalid
    pointer") after everything was written; os._exit skips that teardown, so nothing unflushed
    may be left (stdout and stderr are flushed here; files must be closed by the caller)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
