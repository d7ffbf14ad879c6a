"""The megakernel's bounded waits: a wait that can never complete gives up at the spin bound, and the
error names the op and what it waited for, instead of hanging."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megakernel.build import default_config_text
from megakernel.plan import make_plan
from megakernel.program import DEP_ALL
from megakernel.runtime import Engine
from microbench.errors import SpinTimeoutError

from megakernel_cases import step_inputs, tiny


@pytest.mark.parametrize("regs", [0, 224])
def test_emulated_wait_that_can_never_complete_raises_not_hangs(tiny, regs):
    """The last op made to wait for itself: its bounded wait trips (nothing else is left to
    wait for anything), the launch ends, and the error names the op and the dependency; with the
    12-warp block of per-role register budgets too (its spare warps have left)."""
    cfg, w, base, plan = tiny
    plan = make_plan(cfg, 4, spin_bound_ns=300_000_000, compute_registers=regs)
    eng = Engine(w, plan, base.clone(), backend="emu")
    i = len(eng.program.ops) - 1
    enc = eng.program.encode().reshape(-1, 16)
    enc[i, 7] = 1  # one dependency ...
    enc[i, 8], enc[i, 9] = i, DEP_ALL  # ... on itself: never satisfiable
    eng.prog_t.copy_(torch.from_numpy(np.ascontiguousarray(enc.reshape(-1))))
    toks, par = step_inputs(cfg, 4, 1)
    with pytest.raises(SpinTimeoutError, match=r"argmax\(L2\) \[op \d+\] dependency 0.*expected 1, last saw 0"):
        eng.step(toks, par, 10, mode="mega")


def test_sentinel_route_wait_is_bounded_and_named(tiny):
    """Top-k run alone (chain mode, its router never ran): its poll of the empty slots gives up at
    the spin bound and the error names the op and the sentinel slots, instead of hanging."""
    cfg, w, base, _ = tiny
    plan = make_plan(cfg, 4, sentinel_route=True, spin_bound_ns=200_000_000)
    eng = Engine(w, plan, base.clone(), backend="emu")
    toks, par = step_inputs(cfg, 4, 1)
    eng.prepare(toks, par, 10)
    i = next(o.index for o in eng.program.ops if o.kind == "topk")
    with pytest.raises(SpinTimeoutError, match=r"topk\(L0\) \[op \d+\].*sentinel slots"):
        eng._launch(i, 1, 0, 4)
        eng._check_watchdog(0)  # what step() does after its launches


def test_every_wait_id_the_kernel_can_report_has_a_message(tiny):
    """The WHAT_* codes are rendered from megakernel/program.py into the kernel; the host names each."""
    from megakernel import program

    cfg, w, base, plan = tiny
    eng = Engine(w, plan, base.clone(), backend="emu")
    codes = [program.WHAT_RING_FULL, program.WHAT_RING_EMPTY, program.WHAT_LOADER_ROUTE, program.WHAT_LOADER_GATE,
             program.WHAT_SENTINEL, program.WHAT_NORM_ROWS, program.WHAT_LOADER_PACE]
    for code in codes:
        msg = eng.describe_wait(3 * 16 + code)
        assert "[op 3]" in msg and f"code {code}" not in msg, msg
    assert f"WHAT_LOADER_GATE = {program.WHAT_LOADER_GATE}" in default_config_text()
