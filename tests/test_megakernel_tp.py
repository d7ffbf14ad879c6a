"""Ranks of the megakernel in the CPU emulation (megakernel/ranks.py): several ranks in one launch,
each with its own parameter block and rank-local block indices."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megakernel.plan import make_plan
from megakernel.program import DEP_ALL
from megakernel.ranks import RankEngine
from megakernel.runtime import Engine
from microbench.errors import SpinTimeoutError

from megakernel_cases import step_inputs, tiny


@pytest.mark.parametrize("ranks,mode,schedule", [(2, "mega", "random"), (2, "chain", "random"), (3, "mega", "rank"),
                                                 (2, "mega", "last")])
def test_ranks_of_one_launch_each_run_their_own_step(tiny, ranks, mode, schedule):
    """R copies of the unsharded model in one emulated launch (Plan.launch_ranks, no tensor
    parallelism), each on its own KV cache from poisoned buffers: every rank's logits, tokens and
    cache are bitwise those of one rank alone, so each block found its rank's parameter block and
    its rank-local index and count (the "rank" schedule starves one rank for the whole launch)."""
    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 2)
    ref_cache = base.clone()
    ref = Engine(w, make_plan(cfg, 4), ref_cache, backend="emu", grid=2).step(toks, par, 40, mode=mode)
    caches = [base.clone() for _ in range(ranks)]
    eng = RankEngine(w, make_plan(cfg, 4, launch_ranks=ranks), caches, backend="emu", grid=2, emu_schedule=schedule)
    eng.poison()
    eng.step(toks, par, 40, mode=mode)
    for k, out in enumerate(eng.rank_outputs()):
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.tokens, ref.tokens), k
        assert caches[k].equal(ref_cache), k


def test_a_rank_that_can_never_finish_trips_a_wait_naming_its_rank(tiny):
    """Rank 1's last op made to wait for itself (its own program table): its bounded wait gives
    up, the launch ends (rank 0 finishes), and the error names rank 1, the op and the dependency."""
    cfg, w, base, _ = tiny
    plan = make_plan(cfg, 4, spin_bound_ns=300_000_000, launch_ranks=2)
    eng = RankEngine(w, plan, [base.clone(), base.clone()], backend="emu", grid=2)
    e1 = eng.engines[1]
    i = len(e1.program.ops) - 1
    enc = e1.program.encode().reshape(-1, 16)
    enc[i, 7] = 1
    enc[i, 8], enc[i, 9] = i, DEP_ALL
    e1.prog_t.copy_(torch.from_numpy(np.ascontiguousarray(enc.reshape(-1))))
    toks, par = step_inputs(cfg, 4, 1)
    with pytest.raises(SpinTimeoutError, match=r"rank 1 block [23] .*argmax\(L2\) \[op \d+\] dependency 0"):
        eng.step(toks, par, 10, mode="mega")
