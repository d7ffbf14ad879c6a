"""The chain's PDL choice (runtime.launch_pdl_flags), on the CPU: the chain launches with PDL
wherever the plan's kernel waits for the previous grid, except the routed ops, whose loader reads
top-k's routing before any wait; chain_nopdl never; mega as before (every launch after the
first)."""
from __future__ import annotations

import pytest

from megakernel.config import preset
from megakernel.plan import make_plan
from megakernel.program import build
from megakernel.runtime import CHAIN_MODES, ROUTED_OPS, launch_pdl_flags


@pytest.fixture(scope="module", params=["tiny", "small"])
def program(request):
    return build(make_plan(preset(request.param), 132, pdl=True), "layer")


def test_chain_uses_pdl_except_for_routed_ops(program):
    flags = launch_pdl_flags(program, True, "chain")
    assert len(flags) == len(program.ops) and not flags[0]
    for o, f in zip(program.ops[1:], flags[1:]):
        assert f == (o.kind not in ROUTED_OPS), (o.index, o.kind)
    routed = [o.index for o in program.ops if o.kind in ROUTED_OPS]
    assert routed and not any(flags[i] for i in routed)
    assert sum(flags) == len(program.ops) - 1 - len(routed)


def test_nopdl_and_plans_without_pdl(program):
    assert launch_pdl_flags(program, True, "chain_nopdl") == [False] * len(program.ops)
    for mode in (*CHAIN_MODES, "mega"):
        assert not any(launch_pdl_flags(program, False, mode))  # a build whose kernels never wait


def test_mega_unchanged(program):
    assert launch_pdl_flags(program, True, "mega") == [i > 0 for i in range(len(program.launches))]
    with pytest.raises(ValueError, match="chain_nopdl"):
        launch_pdl_flags(program, True, "chains")
