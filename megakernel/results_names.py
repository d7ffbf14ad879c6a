"""One naming convention for decode-step results, shared by the torch baselines
(`model.baselines`) and the megakernel (`megakernel.step`), so a baseline and the megakernel for
the same (preset, T, ctx) line up by name, and their params carry the keys reports/megakernel.py
reads (impl, preset, tokens, context, batch)."""
from __future__ import annotations

import re

_NAME = re.compile(r"^(?P<preset>[^/]+)/T(?P<T>\d+)/ctx(?P<ctx>\d+)/(?P<impl>[^/]+)$")


def step_series_name(preset: str, n_tokens: int, ctx: int, impl: str) -> str:
    """`{preset}/T{T}/ctx{ctx}/{impl}`, e.g. `shard8/T16/ctx2048/graph`."""
    for what, v in (("preset", preset), ("impl", impl)):
        if not v or "/" in v:
            raise ValueError(f"step series {what} {v!r} must be non-empty and contain no '/'")
    if int(n_tokens) != n_tokens or n_tokens < 1 or int(ctx) != ctx or ctx < 0:
        raise ValueError(f"step series needs T >= 1 and ctx >= 0 as integers, got T={n_tokens!r} ctx={ctx!r}")
    return f"{preset}/T{int(n_tokens)}/ctx{int(ctx)}/{impl}"


def parse_step_series_name(name: str) -> tuple[str, int, int, str]:
    """Inverse of step_series_name: (preset, T, ctx, impl)."""
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a step series name (expected preset/T<n>/ctx<n>/impl)")
    return m["preset"], int(m["T"]), int(m["ctx"]), m["impl"]


def step_params(preset: str, n_tokens: int, ctx: int, impl: str, distinct_experts: int, batch: int = 1,
                **extra) -> dict:
    """The params every step series carries. Keys read by reports/megakernel.py: impl (e.g.
    "torch_eager", "mega"), preset, tokens, context, batch; the short T / ctx duplicates match the
    series name. Extra keys (e.g. baseline="eager") are added after the fixed ones."""
    p = {"preset": preset, "T": int(n_tokens), "ctx": int(ctx), "tokens": int(n_tokens), "context": int(ctx),
         "batch": int(batch), "impl": impl, "distinct_experts": int(distinct_experts)}
    for k in extra:
        if k in p:
            raise ValueError(f"step_params: {k!r} is a fixed key")
    p.update(extra)
    return p


# A profiled tensor-parallel step's waits at its collectives (megakernel/ranks.py tp_waits_result;
# the report's tensor-parallelism block)
TP_WAITS = "megakernel.tp_waits"


# Impl labels of row-group steps. UNION_IMPL: the label some committed results give the union
# build (Plan.union_experts), the default that results name "mega"; the report reads it as "mega".
# PER_GROUP_IMPL: the report's name for a mega step in row groups without the union (the ablation,
# or a result of a build without it), read from the result's metrics; PER_GROUP_CHAIN the same for
# a chain step.
UNION_IMPL = "mega_union"
PER_GROUP_IMPL = "mega_per_group"
PER_GROUP_CHAIN = "chain_per_group"
