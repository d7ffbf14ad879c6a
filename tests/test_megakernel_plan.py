"""The megakernel's build constants on the CPU: plans from the model and the tuned constants, their
rendering into the kernel source, what the builds compile to (NVRTC, no GPU), and the plan
switches that change the code but not the bits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel import plan as plan_mod
from megakernel.build import CSRC, default_config_text, source
from megakernel.config import preset
from megakernel.plan import make_plan, render
from megakernel.runtime import Engine
from microbench.errors import KernelDoesNotFitError

from megakernel_cases import modes_match_reference, step_inputs, tiny


def test_default_config_header_is_current():
    assert (CSRC / "mk" / "default_config.cuh").read_text() == default_config_text(), \
        "regenerate csrc/mk/default_config.cuh: megabench mk default-config --write"


@pytest.mark.parametrize("name", ["tiny", "small", "shard8"])
def test_plan_fits_and_renders(name):
    plan = make_plan(preset(name), 132)
    assert plan.smem_bytes <= 232448
    text = render(plan)
    assert f"constexpr int D = {plan.cfg.d_model};" in text
    for t in plan.tiles.values():
        assert t.k % t.kc == 0 and t.stage_bytes <= plan.stage_bytes


def test_plan_refuses_what_does_not_fit():
    with pytest.raises(KernelDoesNotFitError, match="shared memory"):
        make_plan(preset("shard8"), 132, ring_stages=12, ring_stage_bytes=32768)
    # an expert unit whose chunk (the model's fp4_kc columns of all its rows) does not fit the stage
    # is halved, and a plan where even the smallest unit does not fit is refused with the sizes named
    wide = dataclasses.replace(preset("tiny"), d_pool=128, d_expert=128)
    t = make_plan(wide, 4, ring_stage_bytes=2048).tiles["expert2"]  # 2304 B of fp4 a stage: 32 rows x 128
    assert (t.rows, t.kc, t.stage_bytes) == (32, 128, 2304)
    assert make_plan(wide, 4).tiles["expert2"].rows == 128  # the default stage takes the whole unit
    # (unreachable through make_plan today: a dense chunk refuses a smaller stage first)
    with pytest.raises(KernelDoesNotFitError, match="expert unit of 32 rows x 128 columns of K=128: a chunk needs "
                                                    "2304 B, the ring stage holds 576 B"):
        plan_mod._expert_tile(128, 128, 576, False)


@pytest.mark.slow
@pytest.mark.parametrize("name,tokens,built", [("small", 16, "make_plan"), ("shard8", 16, "make_plan"),
                                               ("small", 16, "plan_for"), ("shard8", 16, "plan_for"),
                                               ("shard8", 1, "plan_for"), ("shard8", 16, "row_groups")])
def test_preset_kernels_compile_for_sm90a_without_spills(name, tokens, built):
    """make_plan's defaults, and the builds the H200 runs: plan_for from the committed tuned
    constants (the ring they give, the fused expert unit, the kept units), per tree size, and with
    8 row groups (the batch of 8 requests of 16 rows; their experts over the union of their routing,
    Plan.union_experts, make_plan's default with row groups). The
    kernel-metrics gate compiles only the tiny default build (csrc/megakernel.cu on its own), which
    cannot fuse, so these are where a spill in a production build shows on the CPU."""
    from microbench.compiler import compile_cuda

    from megakernel.build import MB_INC
    from megakernel.plans import plan_for

    if built in ("plan_for", "row_groups"):  # row groups: 8 of them, B = 8 requests of 16 rows
        kw = {"row_groups": 8} if built == "row_groups" else {}
        plan = plan_for(name, n_sm=132, tokens=tokens, **kw)
        assert plan.fused_experts and plan.keep_units > 0 and plan.ring_fill > 0
    else:
        plan = make_plan(preset(name), 132, stream_evict_first=True, tokens=tokens)
    mod = compile_cuda(source(plan), name=f"megakernel-{name}-T{tokens}-{built}", include_dirs=[CSRC, MB_INC])
    u = mod.usage("mk_run")
    assert u.spills == 0, u
    assert u.registers <= 224  # 288 threads, one block per SM: 65536 / 288 rounded to the allocation granule


@pytest.mark.slow  # ~18 s; CI runs it
def test_layout_pad_moves_the_code_and_keeps_the_bits(tiny):
    """Plan.layout_pad, an A/B's code-layout placebo: the same kernel with never-run instructions
    ahead of its body, so every later instruction sits ~layout_pad bytes further on; layout_gap
    the same inside compute_loop. The steps are bitwise the same. Sizes that are not whole
    instructions are refused."""
    from microbench.compiler import compile_cuda

    from megakernel.build import MB_INC

    cfg, w, base, plan = tiny
    size = {}
    for pad, gap in ((0, 0), (256, 0), (0, 256)):
        p = make_plan(cfg, 132, layout_pad=pad, layout_gap=gap)
        assert f"constexpr int LAYOUT_PAD = {pad};" in render(p) and f"constexpr int LAYOUT_GAP = {gap};" in render(p)
        size[pad, gap] = compile_cuda(source(p), name=f"megakernel-pad{pad}-gap{gap}",
                                      include_dirs=[CSRC, MB_INC]).usage("mk_run").code_bytes
    assert size[256, 0] - size[0, 0] >= 256 and size[0, 256] - size[0, 0] >= 256, size
    toks, par = step_inputs(cfg, 5, 11)
    a = Engine(w, plan, base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    padded = dataclasses.replace(plan, layout_pad=512, layout_gap=512)
    b = Engine(w, padded, base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    assert torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens)
    for bad in (8, -16, 65552, 1.5):
        with pytest.raises(ValueError, match="layout_pad"):
            make_plan(cfg, 4, layout_pad=bad)
        with pytest.raises(ValueError, match="layout_gap"):
            make_plan(cfg, 4, layout_gap=bad)


def test_compute_registers_split_the_budget_between_roles(tiny):
    """Plan.compute_registers, per-role register budgets: a 12-warp block (the loader's warpgroup
    of 4) whose compute warpgroups take N registers with setmaxnreg.inc and whose loader group
    gives back what makes the CTA's pool balance (8 x (N - 168) = 4 x (168 - loader)), or the
    compute warps would wait forever. The cubin carries both instructions with those budgets and
    does not spill; make_plan's default (0) stays 9 warps without them; the emulated step (the extra
    warps only leave) is bitwise the default's; budgets setmaxnreg or the pool cannot take are
    refused."""
    from microbench.compiler import compile_cuda
    from microbench.sass import count_matching, find_disassembler, sass_by_kernel

    from megakernel.build import MB_INC

    cfg, w, base, plan = tiny
    assert plan.compute_registers == 0 and plan.threads == 288 and "constexpr int COMPUTE_REGS = 0;" in render(plan)
    split = make_plan(cfg, 132, compute_registers=224)
    assert split.threads == 384 and split.loader_registers == 56
    assert 8 * (224 - 168) == 4 * (168 - split.loader_registers)
    text = render(split)
    assert "constexpr int THREADS = 384;" in text and "constexpr int LOADER_REGS = 56;" in text
    mod = compile_cuda(source(split), name="megakernel-creg224", include_dirs=[CSRC, MB_INC])
    u = mod.usage("mk_run")
    assert u.spills == 0 and u.registers == 168, u  # the launch bounds' budget at entry
    if find_disassembler() is not None:  # CI has cuobjdump; without one the rendered budgets above stand
        sass = sass_by_kernel(mod.cubin)["mk_run"]
        assert count_matching(sass, r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, 0xe0\b") == 1, "compute warps: inc to 224"
        assert count_matching(sass, r"USETMAXREG\.DEALLOC\.CTAPOOL 0x38\b") >= 1, "loader group: dec to 56"
        default = sass_by_kernel(compile_cuda(source(make_plan(cfg, 132)), name="megakernel-creg0",
                                              include_dirs=[CSRC, MB_INC]).cubin)["mk_run"]
        assert count_matching(default, "USETMAXREG") == 0
    toks, par = step_inputs(cfg, 5, 11)
    a = Engine(w, plan, base.clone(), backend="emu").step(toks, par, 40, mode="mega")
    b = Engine(w, dataclasses.replace(plan, compute_registers=224), base.clone(), backend="emu").step(
        toks, par, 40, mode="mega")
    assert torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens)
    for bad in (168, 236, 240, 180, 1.5, -8):
        with pytest.raises(ValueError, match="compute_registers"):
            make_plan(cfg, 4, compute_registers=bad)
    # the pipeline's builds (profiled or not) take the budgets unless a switch says otherwise
    from megakernel.plans import NONE, ROLE_REGISTERS, plan_for

    assert plan_for("tiny", None, 4).compute_registers == ROLE_REGISTERS == 224
    assert plan_for("tiny", None, 4, profile=True).compute_registers == ROLE_REGISTERS
    assert plan_for("tiny", None, 4, compute_registers=0).threads == 288
    assert plan_for("tiny", None, 4, **NONE).compute_registers == 0


@pytest.mark.slow  # ~20 s of builds; CI runs it
def test_expert_units_follow_the_tree_size_of_the_build():
    # plan.expert1_unit_rows: 256-row gate/up units for a build whose step has units for two rounds
    # of the grid even then (shard8 T=16 on 132 SMs), 128 rows otherwise (T=1: 8 experts)
    cfg, ring = preset("shard8"), dict(ring_stages=2, ring_stage_bytes=32768, fill_ring=True)  # the H200's
    t16, t1 = make_plan(cfg, 132, tokens=16, **ring), make_plan(cfg, 132, tokens=1, **ring)
    assert make_plan(cfg, 132, **ring).tiles["expert1"] == t16.tiles["expert1"]  # default: max_tree tokens
    assert (t16.tiles["expert1"].rows, t1.tiles["expert1"].rows) == (256, 128)
    # down projection: 256 rows, halved where a step's units would not reach every block (T=1: 8 x 8)
    assert (t16.tiles["expert2"].rows, t1.tiles["expert2"].rows) == (256, 128)
    # chunks of the model's 256 columns (one copy of the banks for every build): a 36 KB stage holds
    # 256 rows of them; the units keep no partials in abuf, so both builds stage the norm operand
    # in panels and take more stages (T=1: the dense chunks set the stage size, 33 KB)
    assert {(t.tiles[n].kc, t.tiles[n].stage_bytes) for t in (t16, t1) for n in ("expert1", "expert2")} == \
        {(256, 36864), (256, 18432)}
    assert (t16.norm_k, t16.ring_stages, t1.norm_k, t1.ring_stages) == (2048, 3, 2048, 4)
    assert make_plan(cfg, 132, tokens=1, expert1_rows=256, **ring).tiles["expert1"].rows == 256  # forced (tests)
    # 16 KB stages: 128-row units (256 rows of 256 columns do not fit), 7 stages
    p = make_plan(cfg, 132, tokens=16, ring_stages=2, ring_stage_bytes=16384, fill_ring=True)
    assert (p.tiles["expert1"].rows, p.tiles["expert1"].kc, p.ring_stages) == (128, 256, 7)
    # emulated, both unit sizes (tiny's 64-column rows: one chunk a unit)
    wide = dataclasses.replace(preset("tiny"), d_expert=256)
    for r in (256, 128):
        plan = make_plan(wide, 4, spin_bound_ns=3_000_000_000, expert1_rows=r)
        assert plan.tiles["expert1"].rows == r
        modes_match_reference(wide, plan, 5, 16, 13, 40, f"{r}-row gate/up units vs reference")


def test_fill_ring_stages_the_normed_operand_in_panels_where_that_buys_a_stage():
    # shard8 with the tuned H200 ring (2 x 32 KB): 16 rows of d_model 4096 take 131 KB of abuf; in
    # two panels of 2048 abuf shrinks to a panel's 16 rows (attention's tile, 32 keys a round, is
    # smaller) and a third stage fits (a fourth of the T=1 build's 33 KB stages; the expert units
    # keep nothing in abuf but their operand)
    cfg = preset("shard8")
    for tokens, stages in ((1, 4), (16, 3)):
        p0 = make_plan(cfg, 132, ring_stages=2, ring_stage_bytes=32768, tokens=tokens)
        p = make_plan(cfg, 132, ring_stages=2, ring_stage_bytes=32768, fill_ring=True, tokens=tokens)
        assert (p0.ring_stages, p0.norm_k, p0.ring_fill) == (2, 4096, 0)
        assert (p.ring_stages, p.norm_k, p.ring_fill) == (stages, 2048, stages - 2)
        assert p.smem_bytes <= 232448 and (232448 < p.smem_bytes + p.stage_bytes
                                           or (p.ring_stages + 1) * p.stage_bytes > plan_mod.RING_FILL_BYTES)
        assert p.abuf_bytes == 16 * (p.norm_k * 2 + plan_mod.ROW_PAD) > p.attn_smem_bytes
        assert p.abuf_bytes < p0.abuf_bytes
        assert "constexpr int NORM_KP = 2048;" in render(p) and f"constexpr int RING_STAGES = {stages};" in render(p)
    # shard8 T=16's fourth 36 KB stage fits the shared memory (misc sized exactly) but not
    # RING_FILL_BYTES: the kept units keep the bytes
    p = make_plan(cfg, 132, ring_stages=2, ring_stage_bytes=32768, fill_ring=True, tokens=16, fused_experts=True)
    assert p.ring_stages == 3 and p.keep_units == 8 and p.stage_bytes == 36864
    assert p.smem_bytes - p.keep_bytes + p.stage_bytes + 16 <= 232448  # a 4th stage fits without kept units
    assert 4 * p.stage_bytes > plan_mod.RING_FILL_BYTES and f"MISC_BYTES = {p.misc_bytes};" in render(p)
    # small's abuf is already the experts' size: no panels, the spare bytes still give stages
    s = make_plan(preset("small"), 132, ring_stages=2, ring_stage_bytes=32768, fill_ring=True)
    assert s.norm_k == s.cfg.d_model and s.ring_stages == 3
    with pytest.raises(ValueError, match="norm_panel 1000: must divide d_model 4096"):
        make_plan(cfg, 132, norm_panel=1000)


def test_plan_reads_tuned_constants_and_refuses_a_malformed_file(tmp_path, monkeypatch):
    """No constants file: documented defaults, said out loud. A malformed one: an error naming it,
    never a silent fallback. The tuned spin bound gets the phase allowance added."""
    import microbench.tune as tune
    from megakernel.plans import PHASE_ALLOWANCE_NS, plan_for
    from microbench.errors import ResultsFileError

    monkeypatch.delenv("MEGABENCH_CONSTANTS", raising=False)
    monkeypatch.setenv("MEGABENCH_CONSTANTS_DIR", str(tmp_path))
    monkeypatch.setattr("megakernel.plans.gpu_count", lambda: 0)  # a CPU build, on a GPU machine too
    with pytest.warns(UserWarning, match="documented defaults"):
        p = plan_for("tiny", None, 4)
    d = tune.TunedConstants.defaults()
    assert p.ring_stages - p.ring_fill == d.ring_stages and p.spin_bound_ns == d.spin_bound_ns + PHASE_ALLOWANCE_NS
    assert p.stream_evict_first is (d.evict_first_pays == 1)  # weights.l2's verdict decides the hint
    measured = dataclasses.replace(d, evict_first_pays=1)
    assert plan_for("tiny", measured, 4).stream_evict_first
    assert not plan_for("tiny", measured, 4, stream_evict_first=False).stream_evict_first  # the ablation's switch
    assert p.pdl is (d.pdl_pays == 1)  # clocks.launch's verdict decides programmatic dependent launch
    assert plan_for("tiny", dataclasses.replace(d, pdl_pays=1), 4).pdl
    assert not plan_for("tiny", dataclasses.replace(d, pdl_pays=1), 4, pdl=False).pdl
    assert p.sentinel_route is (d.sentinel_pays == 1)  # sync.publish's verdict decides the sentinel edge
    assert plan_for("tiny", dataclasses.replace(d, sentinel_pays=1), 4).sentinel_route
    assert not plan_for("tiny", dataclasses.replace(d, sentinel_pays=0), 4).sentinel_route
    (tmp_path / "nvidia-h200.json").write_text('{"schema": "megabench.constants", "version": 1}')
    with pytest.raises(ResultsFileError, match="nvidia-h200.json"):
        plan_for("tiny", None, 4)
