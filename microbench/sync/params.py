"""Kernel parameter blocks and enums, read from the CUDA sources (the single source of layouts).

The sync kernels take one pointer: a u64 array indexed by an enum in the .cu file (PP_*, PB_*, ...).
`Layout` parses that enum, so host and device cannot drift apart; `pack` refuses unknown or
missing fields by name.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

SYNC_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def parse_enum(path: str | Path, name: str) -> dict[str, int]:
    """{enumerator: value} of `enum name [: type] { ... };` in a C++ source (implicit values count up)."""
    text = Path(path).read_text()
    m = re.search(r"enum\s+" + re.escape(name) + r"\s*(?::\s*\w+\s*)?\{(.*?)\};", text, re.S)
    if not m:
        raise ValueError(f"{path}: no enum {name}")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    out: dict[str, int] = {}
    nxt = 0
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            k, v = (t.strip() for t in item.split("=", 1))
            if re.fullmatch(r"[0-9]+|0[xX][0-9a-fA-F]+", v):
                val = int(v, 0)
            elif v in out:
                val = out[v]
            else:
                raise ValueError(f"{path}: enum {name}: cannot evaluate {item!r}")
        else:
            k, val = item, nxt
        if not re.fullmatch(r"[A-Za-z_]\w*", k):
            raise ValueError(f"{path}: enum {name}: bad enumerator {k!r}")
        if k in out:
            raise ValueError(f"{path}: enum {name}: {k} defined twice")
        out[k] = val
        nxt = val + 1
    return out


def source(name: str) -> Path:
    return SYNC_DIR / name


class Layout:
    """A parameter block layout: enum `enum` of `path`, fields named without `prefix`, size `count`."""

    def __init__(self, path: str | Path, enum: str, prefix: str, count: str):
        vals = parse_enum(str(path), enum)
        if count not in vals:
            raise ValueError(f"{path}: enum {enum} lacks the count enumerator {count}")
        self.n = vals[count]
        self.prefix = prefix
        self.index = {k[len(prefix):].lower(): v for k, v in vals.items() if k != count and k.startswith(prefix)}
        if sorted(self.index.values()) != list(range(self.n)):
            raise ValueError(f"{path}: enum {enum} is not a dense 0..{self.n - 1} layout")

    def pack(self, values: Mapping[str, object]) -> np.ndarray:
        """One block as uint64[n]; values are ints, numpy ints, or tensors (-> their data pointer)."""
        unknown = set(values) - set(self.index)
        missing = set(self.index) - set(values)
        if unknown or missing:
            raise KeyError(f"parameter block {self.prefix}*: unknown {sorted(unknown)}, missing {sorted(missing)}")
        out = np.zeros(self.n, dtype=np.uint64)
        for k, v in values.items():
            if hasattr(v, "data_ptr"):
                v = v.data_ptr()
            v = int(v)
            if v < 0:
                v &= (1 << 64) - 1  # e.g. NONE given as -1
            if v >= 1 << 64:
                raise ValueError(f"parameter {self.prefix}{k.upper()} = {v} does not fit 64 bits")
            out[self.index[k]] = v
        return out


def upload(blocks: list[np.ndarray], device: str = "cuda"):
    """Stack parameter blocks into one device tensor; returns (tensor, [pointer of each block])."""
    import torch  # heavy: torch

    if not blocks:
        raise ValueError("no parameter blocks to upload")
    arr = np.stack(blocks).view(np.int64)
    t = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
    row = arr.shape[1] * 8
    return t, [t.data_ptr() + i * row for i in range(len(blocks))]
