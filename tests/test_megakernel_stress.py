"""The twin-engine stress run (megakernel/stress.py) in the host emulation: a short run of tiny is
clean, and one flipped bit in one twin's KV cache is caught (the check can fail)."""
from __future__ import annotations

import pytest

from megakernel.config import ConfigError, preset
from megakernel.plan import make_plan
from megakernel.stress import stress
from megakernel.weights import generate


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return generate(cfg), make_plan(cfg, 4, spin_bound_ns=3_000_000_000)


def test_twins_alternating_modes_agree_bitwise(tiny):
    w, plan = tiny
    run = stress(w, plan, 6, backend="emu", prompt=(5, 9), kv_every=2)
    assert run.ok and run.steps == 6 and run.kv_checks == 4, run.mismatches + run.hangs


def test_one_flipped_kv_bit_in_one_twin_is_a_mismatch(tiny):
    """Mutation: the check must see a twin whose cache was corrupted behind its back."""
    w, plan = tiny
    run = stress(w, plan, 4, backend="emu", prompt=(5, 9), kv_every=1, corrupt_at=3)
    assert not run.ok and run.n_mismatches >= 1
    assert run.mismatches[0].startswith("step 3"), run.mismatches


def test_a_run_longer_than_the_cache_is_refused(tiny):
    w, plan = tiny
    with pytest.raises(ConfigError, match="positions"):
        stress(w, plan, w.cfg.max_context, backend="emu")
