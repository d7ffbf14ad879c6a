"""CPU tests of the weights sweep planning: which rings fit in shared memory (and the refusal
reasons), the quick subset, read/chase/routing planning, and the kernels' compile-time facts."""
from __future__ import annotations

import numpy as np
import pytest

from microbench.weights import plan
from microbench.weights.plan import H200_SMEM, KiB, MiB, RingConfig


def test_ring_limits_parsed_from_the_header():
    lim = plan.ring_limits()
    assert lim.max_stages == 8
    assert lim.header_bytes >= 2 * 8 * lim.max_stages and lim.header_bytes % 128 == 0
    assert lim.max_stage_bytes == (1 << 20) - 16


def test_ring_limits_parser_refuses_a_header_without_the_constant(tmp_path):
    p = tmp_path / "ring.cuh"
    p.write_text("constexpr uint32_t kRingMaxStages = 8;\n")
    with pytest.raises(RuntimeError, match="kRingHeaderBytes"):
        plan.ring_limits.__wrapped__(p)


def test_smem_bytes_is_header_plus_slots():
    lim = plan.ring_limits()
    assert RingConfig(5, 32 * KiB).smem_bytes() == lim.header_bytes + 5 * 32 * KiB


@pytest.mark.parametrize("stages,kib", [(2, 4), (7, 32), (3, 64), (8, 24), (5, 32), (6, 36)])
def test_configs_that_fit_the_h200(stages, kib):
    assert plan.refusal(RingConfig(stages, kib * KiB), H200_SMEM) is None


@pytest.mark.parametrize("stages,kib,pattern", [
    (8, 32, r"262400 B > 232448 B opt-in"),  # 256 KiB + header + static
    (4, 64, r"> 232448 B opt-in"),
    (5, 48, r"246016 B > 232448 B"),
    (9, 4, r"kRingMaxStages = 8"),
    (1, 32, r">= 2 stages"),
])
def test_configs_refused_with_a_reason(stages, kib, pattern):
    why = plan.refusal(RingConfig(stages, kib * KiB), H200_SMEM)
    assert why is not None
    assert RingConfig(stages, kib * KiB).label in why
    import re

    assert re.search(pattern, why), why


def test_stage_bytes_must_be_bulk_copy_granules_and_fit_a_tx_count():
    assert "multiple of 16" in plan.refusal(RingConfig(2, 1000), H200_SMEM)
    huge = plan.SmemBudget(1 << 24, 1 << 24, 0, 0)
    assert "transaction count" in plan.refusal(RingConfig(2, 1 << 20), huge)


def test_per_sm_capacity_is_checked_separately_from_the_per_block_limit():
    b = plan.SmemBudget(optin_per_block=232448, per_sm=200 * 1024, reserved_per_block=1024, static_bytes=0)
    why = plan.refusal(RingConfig(7, 32 * KiB), b)  # fits the block limit, not the SM
    assert why and "per SM" in why


def test_static_smem_counts_against_the_budget():
    cfg = RingConfig(7, 32 * KiB)  # 229376 + 128 header
    assert plan.refusal(cfg, H200_SMEM) is None
    fat = plan.SmemBudget(232448, 233472, 1024, static_bytes=4096)
    assert "4096 B static" in plan.refusal(cfg, fat)


def test_full_sweep_on_the_h200():
    p = plan.ring_sweep(False, H200_SMEM)
    assert len(p.fits) + len(p.refused) == len(plan.FULL_STAGES) * len(plan.FULL_STAGE_BYTES)
    assert all(plan.refusal(c, H200_SMEM) is None for c in p.fits)
    assert all(c.smem_bytes() + H200_SMEM.static_bytes <= H200_SMEM.optin_per_block for c in p.fits)
    refused = {c for c, _ in p.refused}
    assert RingConfig(8, 32 * KiB) in refused and RingConfig(7, 32 * KiB) in p.fits
    assert RingConfig(3, 64 * KiB) in p.fits and RingConfig(4, 64 * KiB) in refused
    assert {c.stages for c in p.fits} == set(range(2, 9))


def test_quick_subset_is_every_ring_candidate_that_fits():
    # the ring rule chooses among the candidates only, so the quick grid measures every one that fits
    # and a quick and a full sweep cannot choose different rings (weights/plan.py CANDIDATE_STAGE_BYTES)
    q = plan.ring_sweep(True, H200_SMEM)
    assert all(plan.ring_candidate(c) for c in q.fits)
    assert set(q.fits) == {c for c in plan.ring_sweep(False, H200_SMEM).fits if plan.ring_candidate(c)}
    assert 6 <= len(q.fits) <= 28
    assert RingConfig(5, 32 * KiB) in q.fits  # the study's ring
    sizes = {}
    for c in q.fits:
        sizes.setdefault(c.ring_bytes, set()).add(c.stages)
    assert any(len(s) > 1 for s in sizes.values())  # same ring size, different depth
    assert min(sizes) <= 32 * KiB and max(sizes) >= 192 * KiB


def test_ring_buffer_bytes_is_whole_stages():
    assert plan.ring_buffer_bytes(48 * KiB) % (48 * KiB) == 0
    assert (1 << 30) - 48 * KiB < plan.ring_buffer_bytes(48 * KiB) <= 1 << 30


def test_ring_wait_description_decodes_the_header_encoding():
    what = 0x52000000 | (1 << 20) | (3 << 16) | 7  # ring_wait_id(full, stage 3, lap 7)
    assert plan.ring_wait_description(what) == "ring slot 3 barrier full (bulk copy landed), lap 7"
    assert "empty" in plan.ring_wait_description(0x52000000 | (2 << 20))
    assert plan.ring_wait_description(42) == "wait id 42"


def test_read_sizes_checked():
    assert plan.check_read_size(2 << 30) == (2 << 30) // 16
    with pytest.raises(ValueError, match="multiple of 16"):
        plan.check_read_size(100)
    with pytest.raises(ValueError, match="32 GiB"):
        plan.check_read_size(1 << 35)


def test_sweep_grids():
    assert 3 <= len(plan.ceiling_sweep(True)) <= 6 and len(plan.ceiling_sweep(False)) > len(plan.ceiling_sweep(True))
    assert all(c.kernel in plan.READ_KERNELS for c in plan.ceiling_sweep(False))
    for quick in (True, False):
        s = plan.l2_sizes(quick)
        assert s[0] == 1 * MiB and s[-1] == 256 * MiB and list(s) == sorted(s)
    assert plan.reps_for(1 * MiB) == 1024 and plan.reps_for(2 << 30) == 1


def test_chase_permutation_is_one_cycle_and_expected_position():
    rng = np.random.default_rng(1)
    n = 1000
    order = plan.cyclic_order(n, rng)
    nxt = plan.next_from_order(order)
    seen, x = set(), int(order[0])
    for _ in range(n):
        seen.add(x)
        x = int(nxt[x])
    assert len(seen) == n and x == int(order[0])  # one cycle through every element
    start = 17
    y = start
    for _ in range(2345):
        y = int(nxt[y])
    assert plan.chase_expected(order, start, 2345) == y


def test_chase_elements_refuses_short_strides():
    assert plan.chase_elements(1 * MiB) == 8192
    with pytest.raises(ValueError, match=">= 128"):
        plan.chase_elements(1 * MiB, stride=64)


@pytest.mark.parametrize("f", [0.0, 0.3, 0.5, 1.0])
def test_routing_has_the_requested_overlap(f):
    rng = np.random.default_rng(2)
    r = plan.make_routing(60, 10, 20, f, rng)
    assert len(r.prefetch) == 10 and len(r.read) == 20
    assert len(set(r.read)) == 20 and len(set(r.prefetch)) == 10
    shared = len(set(r.prefetch) & set(r.read))
    assert shared == round(f * 10) == r.shared
    assert abs(r.overlap - round(f * 10) / 10) < 1e-12


def test_routing_refuses_impossible_requests():
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="overlap"):
        plan.make_routing(60, 10, 20, 1.5, rng)
    with pytest.raises(ValueError, match="experts"):
        plan.make_routing(25, 10, 20, 0.0, rng)


def test_expert_pool_covers_routing_and_three_l2s():
    l2 = 60 * MiB
    assert plan.expert_pool(3584 * KiB, 10, 20, l2) * 3584 * KiB >= 3 * l2
    assert plan.expert_pool(64 * MiB, 10, 20, l2) == 30
    with pytest.raises(ValueError, match="multiple of 16"):
        plan.expert_pool(1000, 1, 2, l2)


def test_weights_kernels_compile_without_spills():
    from microbench.compiler import compile_cuda
    from microbench.weights.kernels import SOURCES

    for which, path in SOURCES.items():
        mod = compile_cuda(path, arch="sm_90a")
        assert mod.resources, which
        for name in mod.resources:
            mod.check_limits(name, max_spill_bytes=0)


def test_ring_kernel_uses_bulk_copies_and_mbarriers_in_sass():
    """The SASS must contain the bulk copy (UBLKCP), the mbarrier try-wait and 16-byte shared
    loads; skipped when no disassembler is available (CI)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    from microbench.compiler import compile_cuda
    from microbench.weights.kernels import SOURCES

    cands = [os.environ.get("MEGABENCH_CUOBJDUMP"), shutil.which("cuobjdump"), "/work/tools/cuobjdump"]
    tool = next((c for c in cands if c and Path(c).is_file()), None)
    if tool is None:
        pytest.skip("no cuobjdump (set MEGABENCH_CUOBJDUMP)")
    mod = compile_cuda(SOURCES["ring"], arch="sm_90a")
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(mod.cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", "-fun", "mb_ring_stream", f.name], capture_output=True, text=True,
                              timeout=60).stdout
    assert "UBLKCP" in sass and "SYNCS.PHASECHK" in sass and "LDS.128" in sass, sass[:2000]
