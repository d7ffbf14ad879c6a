"""Token trees for speculative verification.

A step verifies T tokens given as `parents` (parents[0] == -1 is the root: the last accepted
token, whose KV is not cached yet; parents[i] < i for the rest, so the list is topologically
ordered). Token i sits at position ctx + depth(i) and attends to the cached prefix (windowed in
sliding layers) and to its ancestors including itself. T == 1 is plain decoding.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import ConfigError


def validate(parents: Sequence[int]) -> list[int]:
    p = [int(x) for x in parents]
    if not p:
        raise ConfigError("a step needs at least one token")
    if p[0] != -1:
        raise ConfigError(f"token 0 must be the root (parent -1), got parent {p[0]}")
    for i, x in enumerate(p[1:], start=1):
        if not 0 <= x < i:
            raise ConfigError(f"token {i} has parent {x}: parents must precede their children (0 <= parent < {i})")
    return p


def depths(parents: Sequence[int]) -> list[int]:
    p = validate(parents)
    d = [0] * len(p)
    for i in range(1, len(p)):
        d[i] = d[p[i]] + 1
    return d


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """bool [T, T]: [i, j] is True when j is i or an ancestor of i."""
    p = validate(parents)
    t = len(p)
    m = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            m[i, j] = True
            j = p[j]
    return m


def chain(t: int) -> list[int]:
    return [-1] + list(range(t - 1))


def paths(parents: Sequence[int]) -> list[list[int]]:
    """Root-to-leaf index paths."""
    p = validate(parents)
    children = {i for i in p if i >= 0}
    leaves = [i for i in range(len(p)) if i not in children]
    out = []
    for leaf in leaves:
        path = []
        j = leaf
        while j >= 0:
            path.append(j)
            j = p[j]
        out.append(path[::-1])
    return out


def binary_ish(t: int, branch_depth: int = 3) -> list[int]:
    """A deterministic tree of t nodes: a main chain with one sibling at each of the first
    `branch_depth` depths (shape only; tokens come from a drafter)."""
    parents = [-1]
    main = [0]
    while len(parents) < t:
        parents.append(main[-1])
        main.append(len(parents) - 1)
        if len(parents) < t and len(main) - 1 <= branch_depth:
            parents.append(main[-2])
    return validate(parents[:t])
