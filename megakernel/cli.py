"""The megakernel's tools: `megabench mk <tool>` (alias `python -m megakernel.cli <tool>`):
  build [--preset P]      compile for sm_90a (no GPU needed) and print code bytes / registers / spills / smem,
                          and code bytes per op when nvdisasm is there
  check-and-bench [--full | --batches] [--presets ...]   on a GPU: the pipeline (checks, then timings), results
                          saved; --batches: the quick points and the batch curve (plans.BATCH_FULL)
  timeline [--preset P]   on a GPU: one profiled step (megakernel.timeline: the trace, the idle time
                          per op, the profiler's cost recording every launch, one in 7, and as many
                          consecutive ones)
  timeline-detail [--preset P]   on a GPU: a profiled step that also stamps staging and ring waits
                          inside units; each op's time in them (megakernel.timeline_detail)
  sanitize-step [--fused]   one tiny step in mega and chain mode (run under
                          compute-sanitizer; --fused: d_pool and d_expert of 256, the fused expert unit)
  program [--preset P]    print the launches and op instances of one step
  default-config [--write]   csrc/mk/default_config.cuh, the generated header megakernel.cu compiles
                          with alone (tiny preset, 132 SMs, the profiler's events included): printed,
                          or regenerated with --write (no GPU)
  step [--preset P] [--batch B] [--tokens T | --tree-sizes T0,T1,..] [--ctx C | --ctxs C0,C1,..] [--seed S]
       [--check] [--schedule S ...]   one step of B requests, each with its own tree, context and KV cache
                          (past 16 rows in row groups of up to 16, at most 8), a seeded random mix where sizes
                          or contexts are not given; without a GPU tiny runs in the host emulation
                          (other presets need one); --check: each request against the reference,
                          against its own B=1 step (bitwise) and mega against chain (bitwise, at each
                          emulated schedule); exit 1 on a mismatch (megakernel.batch)
  step --ranks R [--check] [--preset P] [--tokens T] [--ctx C] [--mode M] [--steps N] [--expert-parallel]
       [--where emu|gpu|torchrun] [--profile [--save [DIR]]]   decode steps of the tensor-parallel build at
                          R ranks where they can run here (torchrun across R GPUs, else R ranks sharing one
                          GPU, else the CPU emulation; it says which); --check: bitwise the unsharded build
                          (R = 1) and the expert-parallel arrangement, close to the reference, slots empty;
                          --profile: the waits at each collective, stalls per layer and skew per rank
                          (megakernel.tp_waits; --save writes it, GPU runs only)
  stress [--preset P] [--steps N] [--save [DIR]]   twin engines decoding N steps (T=1, real routing),
                          alternating mega and chain: every step's logits, token and the KV caches
                          compared bitwise; exit 1 on a mismatch or a wait that gave up
                          (megakernel/stress.py; tiny in the host emulation without a GPU)
  sm-map [--point PRESET:T:CTX ...] [--variant NAME[:KEY=VALUE,...] ...] [--out FILE.md] [--save [DIR]]   on a GPU:
                          which SM each block ran on, launch after launch, and how often a block
                          keeps its SM (megakernel.sm_map)
  ncu-op --op K [K ...]   on a GPU: one chain-mode step up to the named ops of one layer, with only
                          those launches inside cudaProfilerStart/Stop (for `ncu --profile-from-start off`)
  ncu-mega [--launch L] [--batch B] [--variant NAME[=CSRC_DIR][:KEY=VALUE,...] ...]   on a GPU: per variant, one
                          mega-mode step up to launch L (PDL off), only launch L inside
                          cudaProfilerStart/Stop: the same layer of several builds in one ncu report
  ncu-stalls CSV [--top N] [--hottest N] [--out FILE.md]   markdown summary of the stall samples in
                          `ncu --page source --csv --print-source sass` output, by execution count (no GPU);
                          with --listing FILE or --preset P [--variant SPEC] also by source line
  ab --variant NAME[=CSRC_DIR][:KEY=VALUE,...] ... [--point PRESET:T:CTX ...] [--rounds N]
     [--build-only] [--out FILE.md] [--save [DIR]]   in-run A/B of kernel variants (megakernel/ab.py):
                          checks, then interleaved timing rounds on a GPU; --build-only compiles them
                          here; --save also writes the typed result (megakernel.ab: every round, the
                          checks, each variant's tree hash and switches, the roofline) under DIR
                          (default reports/results)
  ab-table RESULT [--out FILE.md]   the markdown table of a saved A/B (no GPU)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from microbench.atomic import check_writable, write_text
from microbench.device import no_gpu_reason
from microbench.errors import MegabenchError, ResultsFileError
from microbench.harness import Harness, Policy
from microbench.results import REPO_ROOT, Env, find, load
from microbench.sass import cubin_instruction_chains, find_nvdisasm, instruction_chains
from microbench.teardown import leave

from .ab import _plan, build_variants, from_result, kernel_tree, parse_point, parse_variant, run_ab, table, to_result
from .config import PRESETS, ConfigError
from .config import preset as get_preset

PRESET_NAMES = sorted(PRESETS)


def _no_gpu(command: str) -> bool:
    """True (after saying why on stderr) when `command` cannot run here for want of a GPU."""
    reason = no_gpu_reason()
    if reason:
        print(f"{command} needs a GPU: {reason}", file=sys.stderr)
    return bool(reason)


def _tiny_without_gpu(command: str, preset: str):
    """Why there is no GPU (None: there is one), or False (after saying so on stderr) when `preset`
    needs one: without a GPU only tiny runs, in the host emulation."""
    why = no_gpu_reason()
    if why and preset != "tiny":
        print(f"{command} --preset {preset} needs a GPU ({why}); without one only tiny runs, in the host emulation",
              file=sys.stderr)
        return False
    return why


def _build(a) -> int:
    from .build import build_gpu, code_bytes_by_op  # heavy: torch (megakernel.build)
    from .plan import make_plan  # heavy: torch (megakernel.plan)

    per_op = find_nvdisasm() is not None
    for name in a.preset:
        plan = make_plan(get_preset(name), a.sm)
        b = build_gpu(plan)
        u = b.usage
        print(f"{name}: {u.code_bytes} B code ({u.sass_instructions} SASS instructions), {u.registers} registers, "
              f"{u.spill_store_bytes}/{u.spill_load_bytes} B spill stores/loads, {u.stack_frame_bytes} B stack, "
              f"{plan.smem_bytes} B dynamic smem (ring {plan.ring_stages} x {plan.stage_bytes} B)")
        if per_op:  # each op's code is fetched cold once per layer when the kernel overflows the icache
            print("  code by op: " + ", ".join(f"{k} {v / 1024:.1f} KB" for k, v in code_bytes_by_op(b).items()))
    if not per_op:
        print("(code bytes per op need nvdisasm: set MEGABENCH_NVDISASM)")
    return 0


def _code(a) -> int:
    """Machine code per op of the builds at the given points, printed and optionally saved as
    `megakernel.code` (the critical-path model's cold-code column reads it). CPU is enough."""
    from .measure import code_result  # heavy: torch (megakernel.measure)

    points = []
    for spec in a.point:
        preset, _, tokens = spec.partition(":")
        if preset not in PRESETS or not tokens.isdigit() or int(tokens) < 1:
            print(f"code: --point {spec!r}: want PRESET:T with PRESET one of {', '.join(PRESETS)} and T >= 1, "
                  "e.g. shard8:16", file=sys.stderr)
            return 2
        points.append((preset, int(tokens)))
    if find_nvdisasm() is None:
        print("code: code per op needs nvdisasm (on PATH, in CUDA_HOME/bin, or MEGABENCH_NVDISASM; Triton's wheel "
              "bundles one under triton/backends/nvidia/bin)", file=sys.stderr)
        return 2
    r = code_result(points, a.sm)
    for s in r.series:
        print(f"{s.name:40s} {s.summary.median / 1024:7.1f} KB")
    if a.save is not None:
        r = for_gpu_of_build(r, Path(a.save) if a.save else None)
        if r is None:
            return 2
        print("saved", r.save(Path(a.save) if a.save else None))
    return 0


def for_gpu_of_build(r, root=None):
    """The code result labelled with the GPU whose megakernel.build ran the same kernels (equal
    code bytes at every preset it holds), so the gate and the retention rule file it under that
    GPU (its series are static: never gated). None, with the reason printed, when no GPU build
    matches: a kernel not yet run on a GPU has its code printed, not saved."""
    base = root or REPO_ROOT / "reports" / "results"
    want = {(s.params["preset"], s.params["tokens"]): int(s.metrics["kernel_code_bytes"]) for s in r.series}
    for f in reversed(find("megakernel.build", base)):
        b = load(f)
        ran = {s.params.get("preset"): int(s.metrics["code_bytes"]) for s in b.series}
        if b.env.gpu and all(ran.get(p) == n for (p, _), n in want.items()):
            e = b.env
            env = dataclasses.replace(r.env, gpu=e.gpu, gpu_uuid=None, cc=e.cc, sm_count=e.sm_count, l2_bytes=e.l2_bytes,
                                      sm_clock_max_mhz=e.sm_clock_max_mhz, mem_clock_max_mhz=e.mem_clock_max_mhz,
                                      driver=None, machine_kind=f"compiled here for {e.machine_kind or e.gpu}")
            note = (f"built without a GPU (NVRTC {r.env.nvrtc}) for {e.gpu}: the kernels equal, in code bytes, those "
                    f"of megakernel.build {e.date} {e.git_sha[:7]} ({f.name})")
            return dataclasses.replace(r, env=env, notes=tuple(r.notes) + (note,))
    print(f"code: no megakernel.build under {base} ran these kernels "
          f"({', '.join(f'{p} T={t} {n} B' for (p, t), n in want.items())}; a build holds one kernel a preset): "
          "the code is printed, not saved (`megabench run` on the GPU saves both)", file=sys.stderr)
    return None


def _check_and_bench(a) -> int:
    if _no_gpu("check-and-bench"):
        return 2
    from .pipeline import run  # heavy: torch (megakernel.pipeline)

    results = run(quick=not a.full, presets=tuple(a.presets), batches=a.batches, ablate=not a.batches)
    for r in results:
        print(f"[{r.benchmark}]")
        for s in r.series:
            frac = f"  {s.fraction_of_bound:.1%} of bound" if s.fraction_of_bound else ""
            print(f"  {s.name:40s} {s.summary.median:.6g} {s.unit}{frac}  {dict(s.metrics)}")
        for k, d in r.derived.items():
            print(f"  -> {k} = {d.value:.4g} {d.unit}")
        for n in r.notes:
            print(f"  note: {n}")

    leave(0)  # results saved and printed; interpreter teardown aborted on the H200


def _timeline(a) -> int:
    if _no_gpu(a.tool):
        return 2

    from .measure import timeline  # heavy: torch (megakernel.measure)

    h = Harness(policy=Policy(budget_s=0.3, max_samples=100, chunk=8))
    r = timeline(h, a.preset, a.tokens, a.ctx, None, detail=a.detail)
    print("saved", r.save())
    for k, d in r.derived.items():
        print(f"  -> {k} = {d.value:.4g} {d.unit}")

    leave(0)


def _sanitize(a) -> int:
    import torch  # heavy: torch

    from . import tree  # heavy: torch (megakernel.tree)
    from .plan import make_plan  # heavy: torch (megakernel.plan)
    from .reference import KVCache  # heavy: torch (megakernel.reference)
    from .runtime import Engine  # heavy: torch (megakernel.runtime)
    from .weights import generate  # heavy: torch (megakernel.weights)

    cfg = get_preset("tiny")
    if a.fused:  # shapes the fused expert unit takes (plan.fuses_experts): its kept activations and partials
        cfg = dataclasses.replace(cfg, d_pool=256, d_expert=256)
    w = generate(cfg, device="cuda")
    cache = KVCache(cfg, device="cuda").fill_random(torch.Generator(device="cuda").manual_seed(1))
    eng = Engine(w, make_plan(cfg, 4, fused_experts=a.fused), cache, backend="gpu", grid=4)
    toks = list(range(1, 9))
    for mode in ("mega", "chain"):
        out = eng.step(toks, tree.binary_ish(8), 20, mode=mode)
        print(mode, out.tokens.tolist())
    return 0


def _launches_profiled(eng, launches, targets, label) -> None:
    """Run `launches` of the prepared step in order, the indices in `targets` alone inside
    cudaProfilerStart/Stop (for `ncu --profile-from-start off`); label(li, first, n, grid) names
    each profiled launch on stdout."""
    import torch  # heavy: torch

    for li, (first, n, wait, grid) in enumerate(launches):
        if li in targets:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        eng._launch(first, n, wait, grid, li)
        if li in targets:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(label(li, first, n, grid))
    torch.cuda.synchronize()


def _ncu_op(a) -> int:
    if _no_gpu("ncu-op"):
        return 2
    from .bench_baselines import step_context, weights_for  # heavy: torch (megakernel.bench_baselines)
    from .plans import plan_for  # heavy: torch (megakernel.plans)
    from .runtime import Engine  # heavy: torch (megakernel.runtime)

    sc = step_context(a.preset, a.tokens, a.ctx)
    eng = Engine(weights_for(a.preset), plan_for(a.preset, tokens=a.tokens), sc.cache0.clone(), backend="gpu")
    routes = [r.cuda() for r in sc.routes]
    eng.step(sc.tokens, sc.parents, a.ctx, mode="chain", routes=routes)  # module load, warm caches
    eng.prepare(sc.tokens, sc.parents, a.ctx, routes)
    ops = eng.program.ops
    unknown = set(a.op) - {o.kind for o in ops}
    if unknown:
        print(f"ncu-op: no op kind {sorted(unknown)} in the {a.preset} program", file=sys.stderr)
        return 2
    # chain mode launches op instance i as launch i; everything before the last target runs so the
    # profiled launches see this step's real inputs (routing, activations)
    targets = {o.index for o in ops if o.kind in a.op and o.layer == a.layer}
    if not targets:
        print(f"ncu-op: layer {a.layer} has none of {a.op}", file=sys.stderr)
        return 2
    _launches_profiled(eng, eng.launches("chain")[:max(targets) + 1], targets,
                       lambda li, first, n, grid: f"profiled launch {li}: {ops[li].kind} layer {ops[li].layer} "
                                                  f"(grid {grid})")
    return 0


def _ncu_mega(a) -> int:
    if _no_gpu("ncu-mega"):
        return 2
    from .bench_baselines import step_context, weights_for  # heavy: torch (megakernel.bench_baselines)
    from .runtime import Engine  # heavy: torch (megakernel.runtime)

    try:
        variants = [parse_variant(v) for v in (a.variant or ["base"])]
        if a.batch < 1:
            raise ConfigError(f"--batch {a.batch}: want 1 or more requests a step")
    except ConfigError as e:
        print(f"ncu-mega: {e}", file=sys.stderr)
        return 2
    w = weights_for(a.preset)
    if a.batch > 1:  # the batch curve's step of B requests (batch.batch_context), past 16 rows in row groups
        from .batch import batch_context, engine_for, group_rows_of, layer_weight_model  # heavy: torch (megakernel.batch)

        bc = batch_context(a.preset, a.batch, a.tokens, a.ctx)

        def engine(v):
            eng = engine_for(w, _plan(a.preset, v, None, a.batch * a.tokens), [c.clone() for c in bc.caches0],
                             backend="gpu")
            eng.step_batch(bc.requests, mode="mega", routes=bc.routes)  # module load, warm caches
            eng.prepare_batch(bc.requests, bc.routes)
            return eng
    else:
        sc = step_context(a.preset, a.tokens, a.ctx)
        routes = [r.cuda() for r in sc.routes]

        def engine(v):
            eng = Engine(w, _plan(a.preset, v, None, a.tokens), sc.cache0.clone(), backend="gpu")
            eng.step(sc.tokens, sc.parents, a.ctx, mode="mega", routes=routes)  # module load, warm caches
            eng.prepare(sc.tokens, sc.parents, a.ctx, routes)
            return eng
    for v in variants:
        with kernel_tree(v.csrc):
            eng = engine(v)
        launches = eng.launches("mega")
        if not 0 <= a.launch < len(launches):
            print(f"ncu-mega: launch {a.launch} outside 0..{len(launches) - 1} ({a.preset})", file=sys.stderr)
            return 2
        # the step's own launches up to L, in order (L's waits are on counters they bump); PDL off,
        # so the profiled launch runs alone, as ncu runs it anyway
        eng.counters[eng.parity].zero_()
        _launches_profiled(eng, launches[:a.launch + 1], {a.launch},
                           lambda li, first, n, grid: f"{v.name}: profiled mega launch {li} "
                                                      f"(ops {first}..{first + n - 1}, grid {grid}, "
                                                      f"{a.batch} x {a.tokens} rows)")
        eng._check_watchdog(True)  # a wait that gave up would make the profile a partial launch's
        if a.batch > 1:  # what the launch's DRAM reads are to be held against
            first, n = launches[a.launch][:2]
            layers = {o.layer for o in eng.program.ops[first:first + n] if o.layer >= 0}
            if layers:
                m = layer_weight_model(w.cfg, layers, bc.routes, group_rows_of(eng, bc.shape), eng.plan.union_experts)
                print(f"{v.name}: model of layers {sorted(layers)} (their dense and routed expert weights; not the LM head, "
                      f"embeddings or KV): " + ", ".join(f"{k} {x} B" for k, x in m.items()))
        del eng
    return 0


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{what} {text!r}: want comma-separated integers, e.g. 3,1,4") from None
    if not out or any(x < 0 for x in out):
        raise ConfigError(f"{what} {text!r}: want non-negative integers, one per request")
    return out


def _step(a) -> int:
    """`step`: with --ranks the tensor-parallel build's steps (_step_ranks), else a step of B requests."""
    if a.ranks is not None:
        extra = [f for f, v in (("--batch", a.batch), ("--tree-sizes", a.tree_sizes), ("--ctxs", a.ctxs),
                                ("--per-group-experts", a.per_group_experts or None),
                                ("--merge-key-groups", a.merge_key_groups or None)) if v is not None]
        if extra:
            print(f"step: --ranks with {', '.join(extra)}: batched steps of the tensor-parallel build are not built",
                  file=sys.stderr)
            return 2
        if a.schedule is not None:
            print("step: --ranks with --schedule: the tensor-parallel steps run the emulation's random schedule "
                  "(`megabench decode --ranks R --schedule rank` starves one rank)", file=sys.stderr)
            return 2
        return _step_ranks(a)
    tp_only = [f for f, v in (("--steps", a.steps != 1), ("--expert-parallel", a.expert_parallel), ("--where", a.where),
                              ("--save", a.save is not None)) if v]
    if tp_only:
        print(f"step: {', '.join(tp_only)} belong to the tensor-parallel steps: add --ranks R", file=sys.stderr)
        return 2
    a.preset = a.preset or "tiny"
    return _step_batch(a)


# --schedule picks the host emulation's fiber schedule; given for a run on GPUs it would be ignored
_GPU_SCHEDULES = ("--schedule picks the host emulation's schedule, and this run is on the GPU, whose hardware "
                  "schedules its blocks: drop --schedule (the emulation runs where there is no GPU)")


def _step_batch(a) -> int:
    from .batch import check_batch, engine_for, make_requests, mix, random_caches  # heavy: torch (megakernel.batch)
    from .groups import groups_needed  # heavy: torch (megakernel.groups)
    from .plan import MAX_ROW_GROUPS, make_plan  # heavy: torch (megakernel.plan)
    from .spans import op_time_by_group  # heavy: torch (megakernel.spans)

    why = _tiny_without_gpu("step", a.preset)
    if why is False:
        return 2
    cfg = get_preset(a.preset)
    try:
        sizes, ctxs = _int_list(a.tree_sizes, "--tree-sizes"), _int_list(a.ctxs, "--ctxs")
        batch = a.batch if a.batch is not None else len(sizes or ctxs or [1])
        for name, v in (("--tree-sizes", sizes), ("--ctxs", ctxs)):
            if v is not None and len(v) != batch:
                raise ConfigError(f"{name}: {len(v)} values for a batch of {batch} requests")
        # the seeded mix where a list does not say (a random tree never takes more than T_MAX / B rows)
        shape = mix(cfg, batch, a.seed, a.tokens if sizes is None else None, a.ctx if ctxs is None else None)
        shape = [(sizes[r] if sizes else t, ctxs[r] if ctxs else c) for r, (t, c) in enumerate(shape)]
        for r, (t, c) in enumerate(shape):
            try:
                cfg.check_step(c, t)
            except ConfigError as e:
                raise ConfigError(f"request {r}: {e}") from None
        if a.schedule is not None and not why:
            raise ConfigError(_GPU_SCHEDULES)
        rows = sum(t for t, _ in shape)
        # past max_tree rows: row groups (groups.GroupEngine), as many as the requests pack into
        groups = groups_needed(cfg.max_tree, [t for t, _ in shape])
        if groups > MAX_ROW_GROUPS:
            raise ConfigError(f"{batch} requests of {'+'.join(str(t) for t, _ in shape)} = {rows} token rows pack "
                              f"into {groups} row groups of at most {cfg.max_tree}; a build has at most "
                              f"{MAX_ROW_GROUPS}")
        if a.per_group_experts and groups == 1:
            raise ConfigError(f"--per-group-experts: {rows} token rows are one row group; the ablation is of 2 or "
                              f"more (more than {cfg.max_tree} rows)")
    except ConfigError as e:
        print(f"step: {e}", file=sys.stderr)
        return 2
    # the profiled build (same op code, same bits): a block records its units of every group's
    # instances, so its records per launch grow with the groups
    prof = {"profile": True, "profile_cap": 128 * groups} if a.profile else {}
    if a.merge_key_groups:
        prof["merge_key_groups"] = True  # another build (one partial a split): other bits, checked the same way
    if why:
        from .weights import generate  # heavy: torch (megakernel.weights)

        print(f"no GPU ({why}): {a.preset} in the host emulation (the kernel's CUDA source on CPU fibers)")
        backend, dev = "emu", "cpu"
        w = generate(cfg)
        plan = make_plan(cfg, 4, spin_bound_ns=3_000_000_000, row_groups=groups,
                         union_experts=not a.per_group_experts if groups > 1 else False,
                         **prof)
    else:
        from .bench_baselines import weights_for  # heavy: torch (megakernel.bench_baselines)
        from .plans import plan_for  # heavy: torch (megakernel.plans)

        backend, dev = "gpu", "cuda"
        w = weights_for(a.preset)
        plan = plan_for(a.preset, **({"tokens": rows} if groups == 1 else {"row_groups": groups,
                                                                           "union_experts": not a.per_group_experts}),
                        **prof)
    caches0 = random_caches(cfg, batch, a.seed, device=dev)
    reqs = make_requests(cfg, shape, a.seed)
    schedules = tuple(a.schedule or ("random", "last"))
    kw = {"emu_schedule": schedules[0]} if backend == "emu" else {}
    eng = engine_for(w, plan, [c.clone() for c in caches0], backend=backend, **kw)
    out = eng.step_batch(reqs, mode=a.mode)
    print(f"{a.preset}: {batch} request(s), {rows} rows" + (f" in {groups} row groups" if groups > 1 else "")
          + ((", each group's own experts (ablation)" if a.per_group_experts else
              ", experts over the union of their routing") if groups > 1 else "")
          + (", attention's key groups merged in the block" if plan.merge_key_groups else "")
          + f", {a.mode} mode ({backend})")
    for r, (t, c) in enumerate(shape):
        print(f"  request {r}: T={t} ctx={c}: greedy tokens {out.request(r).tokens.tolist()}")
    if a.profile:
        tl = eng.timeline(a.mode)
        clock = "the GPU's globaltimer" if backend == "gpu" else "the emulation's CPU time: not a GPU's timing"
        print(f"profile ({clock}): each op kind's work and wait phases, block-us summed over blocks and layers, "
              "by row group" + (f"; problems: {'; '.join(tl.problems[:3])}" if tl.problems else ""))
        for kind, g, work, wait in op_time_by_group(tl.spans_df(), eng.program):
            print(f"  {kind:<12} group {g}: work {work:12.1f}  wait {wait:12.1f}")
    if not a.check:
        return 0
    res = check_batch(w, plan, caches0, reqs, backend=backend, schedules=schedules)
    for line in res.lines():
        print("  " + line)
    print("check: " + ("passed" if res.ok else f"FAILED ({len(res.problems)} mismatches)"))
    return 0 if res.ok else 1


def _decode(a) -> int:
    """`megabench decode`: a speculative run on the device (megakernel.decode), its acceptance and
    the step's split; --check against plain greedy decoding (exit 1 on a difference). --ranks R:
    the verifier as R tensor-parallel ranks where ranks.where_ranks picks (or --where): R GPUs
    under torchrun (one process per GPU, a drafter in each: decode.run_torchrun), else R ranks in
    one launch on one GPU with its SMs shared out, else the CPU emulation; the run says which."""
    from . import speculative  # heavy: torch (megakernel.speculative)
    from .decode import BATCHES, SpecPair, decode, max_tokens, summary_lines  # heavy: torch (megakernel.decode)
    from .decode import prompts_for  # heavy: torch (megakernel.decode)
    from .decode import to_result as decode_result  # heavy: torch (megakernel.decode)
    from .draft import DraftConfig, draft_model_config  # heavy: torch (megakernel.draft)
    from .plan import MAX_ROW_GROUPS, tp_problem  # heavy: torch (megakernel.plan)
    from .ranks import where_ranks  # heavy: torch (megakernel.ranks)
    from .reference import KVCache  # heavy: torch (megakernel.reference)

    why = no_gpu_reason()
    cfg = get_preset(a.preset)
    where, where_why = None, None
    try:
        if a.ranks < 1:
            raise ConfigError(f"--ranks {a.ranks}: want 1 or a number of tensor-parallel ranks (2, 4, 8)")
        if a.where is not None and a.ranks == 1:
            raise ConfigError("--where picks where --ranks R ranks run: add --ranks R (R > 1)")
        if a.ranks > 1:
            bad = tp_problem(cfg, a.ranks)
            if bad:
                raise ConfigError(f"--ranks {a.ranks}: {a.preset} does not shard so: {bad}")
            where, where_why = where_ranks(a.ranks, a.where)
        if a.schedule == "rank" and a.ranks == 1:
            raise ConfigError("--schedule rank starves one rank of a launch of several: add --ranks R (R > 1)")
    except ConfigError as e:
        print(f"decode: {e}", file=sys.stderr)
        return 2
    emulated = where == "emu" if where is not None else bool(why)
    if a.schedule is not None and not emulated:
        print(f"decode: {_GPU_SCHEDULES}", file=sys.stderr)
        return 2
    if emulated and a.preset != "tiny":
        print(f"decode --preset {a.preset} needs a GPU ({why}); without one only tiny runs, in the host emulation"
              if why else f"decode --preset {a.preset} --where emu: the host emulation runs only tiny", file=sys.stderr)
        return 2
    try:
        if a.full_trees and (a.batch < 2 or a.ranks > 1):
            raise ConfigError(f"--full-trees: a row group per request, for --batch 2..{MAX_ROW_GROUPS} on one rank "
                              f"(got --batch {a.batch}, --ranks {a.ranks})")
        if a.per_group_experts and not a.full_trees:
            raise ConfigError("--per-group-experts: each row group streaming its own experts (the ablation of their "
                              "union), with --full-trees only")
        if a.full_trees and a.batch > MAX_ROW_GROUPS:
            raise ConfigError(f"--batch {a.batch}: full trees take at most {MAX_ROW_GROUPS} requests (a row group each)")
        if not a.full_trees and a.batch not in BATCHES:
            raise ConfigError(f"--batch {a.batch}: a speculative step takes {', '.join(map(str, BATCHES))} requests")
        if a.prompt_len < 1:
            raise ConfigError(f"--prompt-len {a.prompt_len}: want at least 1 token (the first root)")
        most = max_tokens(cfg, a.batch, a.prompt_len, a.full_trees)
        if not 1 <= a.tokens <= most:
            raise ConfigError(f"--tokens {a.tokens}: {a.preset} at --batch {a.batch} with a prompt of {a.prompt_len} "
                              f"holds 1..{most} tokens per request (MAX_OUT and its {cfg.max_context} cached positions)")
        if a.agree is not None:
            name, agree, source = "custom", a.agree, "given with --agree"
            DraftConfig(agree=agree).validate()
        else:
            name = a.acceptance
            agree, source = speculative.agreement(name, a.preset), speculative.agreement_source(name, a.preset)
    except ConfigError as e:
        print(f"decode: {e}", file=sys.stderr)
        return 2
    if a.json:
        check_writable(a.json)
    print(f"acceptance {name!r} on {a.preset}: agree {agree:g} ({source})")
    if where == "torchrun":
        print(f"{a.ranks} tensor-parallel ranks of the verifier: {where_why}; a drafter in each process", flush=True)
        return _decode_torchrun(a, name, agree, source)
    if where is not None:
        print(f"{a.ranks} tensor-parallel ranks of the verifier: {where_why}; the drafter runs once, unsharded")
    dcfg = draft_model_config(cfg, DraftConfig(agree=agree))
    tp = dict(tp_ranks=a.ranks, launch_ranks=a.ranks) if a.ranks > 1 else {}
    # request r in row group r of both engines
    groups = {"row_groups": a.batch, "union_experts": not a.per_group_experts} if a.full_trees else {}
    if emulated:
        from .plan import make_plan  # heavy: torch (megakernel.plan)
        from .weights import generate  # heavy: torch (megakernel.weights)

        if why:
            print(f"no GPU ({why}): {a.preset} in the host emulation (the kernel's CUDA source on CPU fibers); its "
                  "times are the CPU's, not a GPU's")
        backend, dev = "emu", "cpu"
        w = generate(cfg)
        # R ranks: a starved rank (the 'rank' schedule) waits through the others' whole launch
        plan = make_plan(cfg, 4, spin_bound_ns=60_000_000_000 if tp else 3_000_000_000, **tp, **groups)
        dplan = make_plan(dcfg, 4, spin_bound_ns=3_000_000_000, **groups)
    else:
        from .bench_baselines import weights_for  # heavy: torch (megakernel.bench_baselines)
        from .plans import plan_for  # heavy: torch (megakernel.plans)

        backend, dev = "gpu", "cuda"
        w = weights_for(a.preset)
        plan = plan_for(a.preset, tokens=cfg.max_tree, **tp, **groups)
        dplan = plan_for(dcfg, tokens=dcfg.max_tree - 1, **groups)
    pair = SpecPair(w, plan, dplan, [KVCache(cfg, device=dev) for _ in range(a.batch)], batch=a.batch, agree=agree,
                    backend=backend, emu_schedule=a.schedule or "random", ranks=a.ranks)
    prompts = prompts_for(cfg, a.batch, a.prompt_len, a.seed)
    verifier = f", the verifier {a.ranks} ranks" if a.ranks > 1 else ""
    verifier += f", a row group per request ({a.batch} groups a step)" if a.full_trees else ""
    if a.full_trees:
        verifier += (", each group's own routed experts (ablation)" if a.per_group_experts else
                     ", routed experts over the union of the groups' routing")
    print(f"{a.preset}: {a.batch} request(s) of a {pair.T}-token tree (branch depth {pair.branch_depth}), drafter "
          f"{pair.dm.cfg.n_layers} layers over {pair.T - 1} slots{verifier}, {a.mode} mode ({backend}); {a.tokens} "
          f"tokens each after a prompt of {a.prompt_len}", flush=True)
    out = decode(pair, prompts, a.tokens, a.mode, check=a.check, poison=a.check,
                 progress=lambda line: print("  " + line, flush=True))
    for line in summary_lines(out, emulated=not pair.gpu):
        print(line)
    for r, t in enumerate(out.read.tokens):
        print(f"request {r}: {len(t)} tokens: {t[:24]}{' ...' if len(t) > 24 else ''}")
    if out.check is not None:
        c = out.check
        plain = "the unsharded build's T=1 megakernel steps" if a.ranks > 1 else "T=1 megakernel steps"
        print(f"check against plain greedy decoding ({plain}): tokens "
              f"{'equal' if all(c.tokens_equal) else 'DIFFER'}; {c.kv_rows} KV rows of the committed positions: "
              f"worst {c.kv_rel_err:.2e} of the plain run's ({c.kv_worst}), {c.kv_flips} above the reference bound "
              f"(router near-ties; another node's row would be ~1.4)")
        if a.ranks > 1:
            ranks_ok = not any(p.startswith("rank ") for p in c.problems)
            print(f"check across ranks: every rank's speculative state (emitted tokens, counts, path, root, histogram) "
                  f"and step contexts {'equal to' if ranks_ok else 'DIFFER from'} rank 0's")
        for p in c.problems:
            print(f"  MISMATCH: {p}")
        print("check: " + ("passed" if c.ok else f"FAILED ({len(c.problems)} mismatches)"))
    if pair.gpu:
        from .plans import constants_env  # heavy: torch (megakernel.plans)

        env = constants_env()
    else:
        env = Env.capture()
    res = decode_result(out, preset=a.preset, batch=a.batch, mode=a.mode, agree=agree, acceptance=name,
                        acceptance_source=source, prompt_len=a.prompt_len, n=a.tokens, env=env, emulated=not pair.gpu,
                        launches=pair.part_launches(a.mode), ranks=a.ranks, where=where, where_why=where_why,
                        row_groups=a.batch if a.full_trees else 1)
    print("not saved (--no-save)" if a.no_save else f"saved {res.save()}")
    if a.json:
        print("wrote", write_text(Path(a.json), json.dumps(res.to_json(), indent=1) + "\n"))
    return 1 if out.check is not None and not out.check.ok else 0


def _decode_torchrun(a, name: str, agree: float, source: str) -> int:
    """`megabench decode --ranks R` across R GPUs under torchrun (decode.run_torchrun): rank 0's
    lines and check printed, its typed result saved; exit 1 where the check failed, 2 where the
    run could not (a rank's error, ranks that disagree, a process that failed)."""
    from .decode import run_torchrun  # heavy: torch (megakernel.decode)

    print(f"{a.preset}: {a.batch} request(s), the verifier {a.ranks} ranks, one process per GPU, {a.mode} mode (gpu); "
          f"{a.tokens} tokens each after a prompt of {a.prompt_len}", flush=True)
    try:
        s, res = run_torchrun(a.ranks, preset=a.preset, tokens=a.tokens, mode=a.mode, batch=a.batch, agree=agree,
                              acceptance=name, acceptance_source=source, prompt_len=a.prompt_len, seed=a.seed,
                              check=a.check)
    except MegabenchError as e:
        print(f"decode: {e}", file=sys.stderr)
        return 2
    for line in s["lines"]:
        print(line)
    for r, t in enumerate(s["tokens"]):
        print(f"request {r}: {len(t)} tokens: {t[:24]}{' ...' if len(t) > 24 else ''}")
    if s["check"] != "not run":
        print("check against plain greedy decoding (the unsharded build's T=1 megakernel steps on rank 0's GPU) and "
              "across ranks (every rank's emitted tokens, speculative state and step contexts gathered to rank 0)")
        for p in s["problems"]:
            print(f"  MISMATCH: {p}")
        print("check: " + ("passed" if s["check"] == "passed" else f"FAILED ({len(s['problems'])} mismatches)"))
    print("not saved (--no-save)" if a.no_save else f"saved {res.save()}")
    if a.json:
        print("wrote", write_text(Path(a.json), json.dumps(res.to_json(), indent=1) + "\n"))
    return 1 if s["check"] == "FAILED" else 0


def add_decode_parser(sub) -> None:
    """`megabench decode` (a top-level command: reports/cli.py adds it with this)."""
    s = sub.add_parser("decode", help="speculative decoding on the device: drafter and verifier megakernels, accepted "
                                      "tokens/s, acceptance, the step's split (tiny in the emulation without a GPU)")
    s.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    s.add_argument("--tokens", type=int, default=64, help="tokens each request emits (default 64)")
    s.add_argument("--mode", default="mega", choices=["mega", "chain"])
    acc = s.add_mutually_exclusive_group()
    acc.add_argument("--acceptance", default="study", help="a named drafter agreement (megakernel/speculative.py "
                                                           "ACCEPTANCE: study, perfect; default study)")
    acc.add_argument("--agree", type=float, default=None, help="the drafter's agreement with the target's backbone, 0..1")
    s.add_argument("--batch", type=int, default=1, help="requests, each its own tree of 16 / B tokens (1, 2, 4, 8)")
    s.add_argument("--full-trees", action="store_true",
                   help="every request the whole 16-token tree, each in a row group of its own (--batch 2..8, one "
                        "rank): each request's steps are its B=1 steps")
    s.add_argument("--per-group-experts", action="store_true",
                   help="--full-trees: the ablation whose every row group streams its own routed experts (default: "
                        "both engines' experts once over the union of the groups' routing)")
    s.add_argument("--ranks", type=int, default=1,
                   help="the verifier as R tensor-parallel ranks (2, 4, 8 where the preset's kv heads divide; tiny: "
                        "2): R GPUs under torchrun where the node has R (one process per GPU, a drafter in each), "
                        "else R ranks sharing one GPU's SMs in one launch, else the CPU emulation (it says which; "
                        "in one launch the drafter runs once, unsharded); --check also compares every rank's "
                        "speculative state")
    s.add_argument("--where", choices=["emu", "gpu", "torchrun"], default=None,
                   help="--ranks: force where the ranks run: emu (the CPU emulation, one launch), gpu (the ranks "
                        "sharing one GPU's SMs, one launch), torchrun (one process per GPU; refused where the node "
                        "has fewer than R GPUs); default: ranks.where_ranks's pick")
    s.add_argument("--prompt-len", type=int, default=8, help="random prompt tokens per request (default 8)")
    s.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    s.add_argument("--check", action="store_true", help="compare with plain greedy decoding (T=1 steps), token for "
                                                        "token and KV row for KV row; exit 1 when they differ")
    s.add_argument("--schedule", default=None, choices=["random", "last", "block", "rank"],
                   help="the host emulation's schedule for mega launches (default random; the emulation only); rank: "
                        "one rank of the verifier's starved (--ranks R)")
    s.add_argument("--json", default=None, metavar="PATH", help="also write the typed result (megakernel.decode) here")
    s.add_argument("--no-save", action="store_true",
                   help="write no result to the results folder: for runs whose timings are not the kernel's (under "
                        "compute-sanitizer, a profiler)")
    s.set_defaults(fn=_decode)


def _program(a) -> int:
    from .plan import make_plan  # heavy: torch (megakernel.plan)
    from .program import build  # heavy: torch (megakernel.program)

    print(build(make_plan(get_preset(a.preset), a.sm), a.mode).describe())
    return 0


def _step_ranks(a) -> int:
    """Decode steps of the TP build at --ranks ranks (megakernel/ranks.py step_ranks)."""
    from .ranks import COLLECTIVES, skews, stalls, step_ranks, tp_waits_result  # heavy: torch (megakernel.ranks)

    if a.save is not None and not a.profile:
        print("step: --save writes the profiled step's waits: add --profile", file=sys.stderr)
        return 2
    run = step_ranks(a.preset or "tinytp", a.ranks, tokens=8 if a.tokens is None else a.tokens,
                     ctx=40 if a.ctx is None else a.ctx, mode=a.mode, steps=a.steps, expert_parallel=a.expert_parallel,
                     check=a.check, profile=a.profile, where=a.where, seed=a.seed)
    for i, t in enumerate(run.tokens):
        print(f"step {i}: tokens {t}")
    if a.profile:
        clock = "the emulation's clock (CPU time, not a GPU's)" if run.where == "emu" else "%globaltimer"
        print(f"collective waits ({clock}): the longest block's wait per rank, median over layers")
        for key, what, _, _ in COLLECTIVES:
            per = {}
            for w in run.waits:
                if w.collective == key and w.wait_ns is not None:
                    per.setdefault(w.rank, []).append(w.wait_ns)
            print(f"  {what}: " + ", ".join(f"rank {r} {sorted(v)[len(v) // 2] / 1e3:.1f} us" for r, v in sorted(per.items())))
        one_clock = run.where != "torchrun"
        sk = skews(run.waits) if one_clock else {}
        st = stalls(run.waits)
        if sk:
            print(f"  skew between ranks: up to {max(sk.values()) / 1e3:.1f} us")
        if st:
            print(f"  stall per layer: up to {max(st.values()) / 1e3:.1f} us (one rank, one layer)")
        if a.save is not None:
            if run.where == "emu":
                print("step: the emulation's waits are CPU time, not a GPU's: printed, not saved", file=sys.stderr)
                return 2
            env = Env.capture()
            r = tp_waits_result(run.waits, preset=a.preset or "tinytp", ranks=a.ranks, where=run.why,
                                one_clock=one_clock, tokens=8 if a.tokens is None else a.tokens,
                                ctx=40 if a.ctx is None else a.ctx, env=env)
            print("saved", r.save(Path(a.save) if a.save else None))
    return 0


def _stress(a) -> int:
    """`megabench mk stress`: twin engines decoding, alternating mega and chain (megakernel/stress.py)."""
    from .stress import stress, to_result  # heavy: torch (megakernel.stress)

    why = _tiny_without_gpu("stress", a.preset)
    if why is False:
        return 2
    cfg = get_preset(a.preset)
    if why:
        from .plan import make_plan  # heavy: torch (megakernel.plan)
        from .weights import generate  # heavy: torch (megakernel.weights)

        print(f"no GPU ({why}): tiny in the host emulation")
        w, plan, backend = generate(cfg), make_plan(cfg, 4, spin_bound_ns=3_000_000_000), "emu"
    else:
        from .bench_baselines import weights_for  # heavy: torch (megakernel.bench_baselines)
        from .plans import plan_for  # heavy: torch (megakernel.plans)

        w, plan, backend = weights_for(a.preset), plan_for(a.preset, tokens=1), "gpu"
    try:
        run = stress(w, plan, a.steps, backend=backend, progress=lambda line: print("  " + line, flush=True))
    except ConfigError as e:
        print(f"stress: {e}", file=sys.stderr)
        return 2
    print(f"{run.preset}: {run.steps} steps, twins alternating mega/chain ({run.backend}) in {run.seconds:.1f} s: "
          f"{run.n_mismatches} mismatches, {len(run.hangs)} hangs, {run.kv_checks} KV-cache comparisons")
    for m in run.mismatches + run.hangs:
        print("  " + m)
    if a.save is not None:
        if backend == "emu":
            print("stress: an emulated run is printed, not saved", file=sys.stderr)
        else:
            print("saved", to_result(run, Env.capture()).save(Path(a.save) if a.save else None))
    return 0 if run.ok else 1


def _default_config(a) -> int:
    """Print csrc/mk/default_config.cuh as build.default_config_text renders it, or with --write
    replace the committed file (atomically; left alone when it is already current)."""
    from .build import CSRC, default_config_text  # heavy: torch (megakernel.build)

    text = default_config_text()
    if not a.write:
        print(text, end="")
        return 0
    path = CSRC / "mk" / "default_config.cuh"
    if path.is_file() and path.read_text() == text:
        print(f"{path}: already current")
        return 0
    write_text(path, text)
    print("wrote", path)
    return 0


def _source_label(chain: list[str]) -> str:
    """"expert_gemm1 mk/gemm.cuh:367": the op an instruction belongs to and its innermost source line."""
    from .build import op_of_chain  # heavy: torch (megakernel.build)

    inner = chain[0]
    for root in ("csrc/", "cuda/"):  # megakernel/csrc/..., microbench/cuda/mb/...
        if root in inner:
            inner = inner.split(root, 1)[1]
            break
    return f"{op_of_chain(chain)} {inner}"


def _sass_chains(a):
    """The profiled kernel's SASS with inline chains (microbench.sass.instruction_chains): from a
    saved `nvdisasm -gi -c` listing, or by rebuilding the kernel here (build_gpu keeps line info,
    and the same source, plan and NVRTC give the same cubin: by_source checks every opcode)."""
    if a.listing:
        p = Path(a.listing)
        if not p.is_file():
            raise ValueError(f"{p}: no such listing (want `nvdisasm -gi -c` output)")
        chains = instruction_chains(p.read_text().splitlines(), kernel="mk_run")
        if not chains:
            raise ValueError(f"{p}: no instructions of mk_run (not an `nvdisasm -gi -c` listing of the megakernel?)")
        return chains
    from .build import KERNEL, build_gpu  # heavy: torch (megakernel.build)

    v = parse_variant(a.variant or "base")
    with kernel_tree(v.csrc):
        cubin = build_gpu(_plan(a.preset, v, a.sm, a.tokens)).module.cubin
    return cubin_instruction_chains(cubin, KERNEL)  # FileNotFoundError without nvdisasm: said, exit 2


def _by_source_markdown(df, chains, top: int) -> str:
    from .build import op_of_chain  # heavy: torch (megakernel.build)
    from .ncu_stalls import by_op, by_source  # heavy: pandas (megakernel.ncu_stalls)

    t = by_source(df, chains, _source_label, top=top)
    # the per-op account: every op's stall samples, largest first, split into its copy
    # waits (its bytes) and its own work, with what the own work stalls on; a sample is one warp's
    # state at one sampling instant, so an op's share is its share of the warps' resident time, not
    # of the critical path (top-k's one block weighs little)
    ops = by_op(df, chains, op_of_chain)
    return "\n".join([f"## Top {top} source positions (op and innermost line; no_inst = instruction-fetch stalls)",
                      "", t.to_markdown(index=False), "",
                      "## Per op (instructions that ran, warp instructions executed, stall samples: at the op's "
                      "copy waits, mk/wait.cuh, and in its own work; own_no_inst = instruction fetch, "
                      "own_long_sb = global and L2 loads)",
                      "", ops.to_markdown(index=False), ""])


def _ncu_stalls(a) -> int:
    from .ncu_stalls import kernels, read_sass_csv, summary_markdown  # heavy: pandas (megakernel.ncu_stalls)

    kernel = int(a.kernel) if a.kernel and a.kernel.isdigit() else a.kernel  # no C++ name is all digits
    try:
        chains = _sass_chains(a) if (a.listing or a.preset) else None
        # no --kernel: every profiled launch of the file, each summarised on its own
        picks = [kernel] if kernel is not None else list(range(len(kernels(a.csv))))
        parts = []
        for k in picks:
            df = read_sass_csv(a.csv, kernel=k)
            head = f"# Launch {k} of {a.csv}\n\n" if len(picks) > 1 else ""
            md = summary_markdown(df, top=a.top, n=a.hottest)
            if chains is not None:
                md += _by_source_markdown(df, chains, a.top_source)
            parts.append(head + md)
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # a user's input: say what is wrong
        print(e, file=sys.stderr)
        return 2
    md = "\n".join(parts)
    if a.out:
        write_text(a.out, md)
        print("wrote", a.out)
    else:
        print(md)
    return 0


def _ab(a) -> int:
    try:
        variants = [parse_variant(v) for v in a.variant]
        points = [parse_point(p) for p in (a.point or AB_POINTS)]
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if a.build_only:
        for preset, t, name, u in build_variants(points, variants, a.sm):
            shape = f"T={t}" if t <= get_preset(preset).max_tree else f"{t} rows"  # a batched point: B x T rows
            print(f"{preset} {shape} {name}: {u.registers} registers, {u.spill_store_bytes} B spill stores, "
                  f"{u.code_bytes} B code")
        return 0
    if _no_gpu("ab"):
        return 2

    results = run_ab(points, variants, rounds=a.rounds)
    md = table(results)
    for r in results:  # reported in the table too; said here where a log's tail shows it
        for name, why in r.failed.items():
            print(f"CHECK FAILED, not timed: {r.label} {name}: {why}", file=sys.stderr)
    if a.out:
        write_text(a.out, md + "\n")
        print("wrote", a.out)
    if a.save is not None:
        print("wrote", to_result(results, variants).save(Path(a.save) if a.save else None))
    print(md)
    return 0


def _ab_table(a) -> int:
    try:
        md = table(from_result(load(a.result)))
    except (ResultsFileError, OSError) as e:
        print(e, file=sys.stderr)
        return 2
    if a.out:
        write_text(a.out, md + "\n")
        print("wrote", a.out)
    print(md)
    return 0


def _sm_map(a) -> int:
    try:
        variants = [parse_variant(v) for v in (a.variant or ["base"])]
        points = [parse_point(p) for p in (a.point or AB_POINTS)]
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if any(v.csrc for v in variants):
        print("sm-map: switches only (NAME[:KEY=VALUE,...]), not a source tree", file=sys.stderr)
        return 2
    if _no_gpu("sm-map"):
        return 2
    from .sm_map import measure  # heavy: torch (megakernel.sm_map)

    lines = ["| point | variant | launches | same SM |", "|---|---|---|---|"]
    rows = []
    if any(len(p) > 3 for p in points):
        print("sm-map: points are PRESET:T:CTX (one request a step)", file=sys.stderr)
        return 2
    for preset, t, ctx in points:
        for v in variants:
            m = measure(preset, t, ctx, v.switch_dict)
            rows.append((preset, t, ctx, v.name, v.switches, m))
            lines.append(f"| {preset} T={t} ctx={ctx} | {v.name} | {m.launches} | {100 * m.same_sm:.1f}% |")
            print(lines[-1], flush=True)
    md = "\n".join(lines)
    if a.out:
        write_text(a.out, md + "\n")
        print("wrote", a.out)
    if a.save is not None:
        from .sm_map import to_result  # heavy: torch (megakernel.sm_map)

        print("wrote", to_result(rows).save(Path(a.save) if a.save else None))
    print(md)
    return 0


AB_POINTS = ("shard8:16:2048", "shard8:1:2048", "small:16:512")


def add_tools(sub) -> None:
    """Add every tool as a subcommand of `sub` (argparse subparsers): `megabench mk <tool>` and
    `python -m megakernel.cli <tool>` share this list."""
    s = sub.add_parser("build", help="compile for sm_90a (no GPU) and print code bytes, registers, spills, smem")
    s.add_argument("--preset", nargs="*", default=["tiny", "small", "shard8"], choices=PRESET_NAMES)
    s.add_argument("--sm", type=int, default=132)
    s.set_defaults(fn=_build)
    s = sub.add_parser("code", help="machine code per op of the builds at --point (needs nvdisasm; no GPU)")
    s.add_argument("--point", nargs="+", default=["shard8:16"], help="PRESET:T (default shard8:16, the timeline's)")
    s.add_argument("--sm", type=int, default=132)
    s.add_argument("--save", nargs="?", const="", default=None, metavar="DIR",
                   help="also save the typed result (megakernel.code) under DIR (default reports/results)")
    s.set_defaults(fn=_code)
    s = sub.add_parser("check-and-bench", help="on a GPU: the megakernel stage (checks, then timings), results saved")
    s.add_argument("--full", action="store_true")
    s.add_argument("--batches", action="store_true", help="the quick points and the batched steps (plans.BATCH_FULL: "
                                                          "B requests a step, chain and mega), no ablation")
    s.add_argument("--presets", nargs="*", default=["tiny", "small", "shard8"], choices=PRESET_NAMES)
    s.set_defaults(fn=_check_and_bench)
    for name, what in (("timeline", "on a GPU: one profiled step (megakernel.timeline)"),
                       ("timeline-detail", "on a GPU: a profiled step that also stamps waits inside units")):
        s = sub.add_parser(name, help=what)
        s.add_argument("--preset", default="shard8", choices=PRESET_NAMES)
        s.add_argument("--tokens", type=int, default=16)
        s.add_argument("--ctx", type=int, default=2048)
        s.set_defaults(fn=_timeline, detail=name == "timeline-detail")
    s = sub.add_parser("sm-map", help="on a GPU: which SM each block ran on, launch after launch (megakernel.sm_map)")
    s.add_argument("--point", nargs="+", help="PRESET:T:CTX (default the A/B's three)")
    s.add_argument("--variant", action="append", help="NAME[:KEY=VALUE,...] as for `ab` (default: base)")
    s.add_argument("--out", help="also write the markdown table here")
    s.add_argument("--save", nargs="?", const="", default=None, metavar="DIR",
                   help="also save the typed result (megakernel.sm_map) under DIR (default reports/results)")
    s.set_defaults(fn=_sm_map)
    s = sub.add_parser("sanitize-step", help="one tiny step in mega and chain mode (run it under compute-sanitizer)")
    s.add_argument("--fused", action="store_true", help="tiny with d_pool and d_expert of 256, fused expert units")
    s.set_defaults(fn=_sanitize)
    s = sub.add_parser("program", help="print the launches and op instances of one step")
    s.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    s.add_argument("--mode", default="layer", choices=["layer", "step"])
    s.add_argument("--sm", type=int, default=132)
    s.set_defaults(fn=_program)
    s = sub.add_parser("default-config", help="the generated header csrc/mk/default_config.cuh (tiny preset, 132 "
                                              "SMs, profiler events included): print it, or --write it (no GPU)")
    s.add_argument("--write", action="store_true", help="regenerate megakernel/csrc/mk/default_config.cuh")
    s.set_defaults(fn=_default_config)
    s = sub.add_parser("step", help="one step of B requests (tiny in the emulation without a GPU), or with --ranks R "
                                    "decode steps of the tensor-parallel build (emulation, one GPU or torchrun, by "
                                    "what is here); --check")
    s.add_argument("--preset", default=None, choices=PRESET_NAMES, help="default: tiny, with --ranks tinytp")
    s.add_argument("--batch", type=int, default=None, help="requests in the step (default 1, or the lists' length)")
    s.add_argument("--tokens", type=int, default=None, help="tree tokens of every request (default: the seeded mix)")
    s.add_argument("--ctx", type=int, default=None, help="cached positions of every request (default: the seeded mix)")
    s.add_argument("--tree-sizes", default=None, help="tree tokens per request, comma-separated")
    s.add_argument("--ctxs", default=None, help="cached positions per request, comma-separated")
    s.add_argument("--seed", type=int, default=0, help="the mix's, the tokens' and the caches' seed")
    s.add_argument("--mode", default="mega", choices=["mega", "chain"])
    s.add_argument("--check", action="store_true", help="reference per request, B=1 equality, mega == chain")
    s.add_argument("--per-group-experts", action="store_true",
                   help="past 16 rows: the ablation whose every row group streams its own routed experts (default: "
                        "once over the union of their routing)")
    s.add_argument("--merge-key-groups", action="store_true",
                   help="the build whose attention blocks merge their key groups' partials, one a split "
                        "(Plan.merge_key_groups; off by default until measured)")
    s.add_argument("--schedule", nargs="+", default=None, choices=["random", "last", "block"],
                   help="emulated mega schedules the check runs (the first also runs the printed step; default random "
                        "last); the host emulation only")
    # tensor parallelism (megakernel/ranks.py step_ranks): --ranks picks these steps
    s.add_argument("--ranks", type=int, default=None, help="tensor-parallel ranks (1, 2, 4 or 8): the TP build's "
                                                           "steps (--tokens default 8, --ctx 40)")
    s.add_argument("--steps", type=int, default=1, help="--ranks: the first step, then greedy steps of one token")
    s.add_argument("--expert-parallel", action="store_true", help="--ranks: each slot's expert units on its owner")
    s.add_argument("--where", choices=["emu", "gpu", "torchrun"], help="--ranks: force where the ranks run")
    s.add_argument("--profile", action="store_true", help="the profiled build: with --ranks the waits at each "
                                                             "collective; else each op kind's work and wait time by "
                                                             "row group")
    s.add_argument("--save", nargs="?", const="", default=None, metavar="DIR",
                   help="--ranks --profile on a GPU: save megakernel.tp_waits under DIR (default reports/results)")
    s.set_defaults(fn=_step)
    s = sub.add_parser("stress", help="twin engines decoding, alternating mega and chain: mismatches and hangs "
                                      "(tiny in the emulation without a GPU)")
    s.add_argument("--preset", default="shard8", choices=PRESET_NAMES)
    s.add_argument("--steps", type=int, default=2000, help="decode steps after a 4-token prompt (default 2000)")
    s.add_argument("--save", nargs="?", const="", default=None, metavar="DIR",
                   help="on a GPU: save megakernel.stress under DIR (default reports/results)")
    s.set_defaults(fn=_stress)
    s = sub.add_parser("ncu-op", help="on a GPU: a chain step up to the named ops, only those inside the profiler range")
    s.add_argument("--preset", default="shard8", choices=PRESET_NAMES)
    s.add_argument("--tokens", type=int, default=16)
    s.add_argument("--ctx", type=int, default=2048)
    s.add_argument("--layer", type=int, default=0)
    s.add_argument("--op", nargs="+", required=True)
    s.set_defaults(fn=_ncu_op)
    s = sub.add_parser("ncu-mega", help="on a GPU: per variant, one mega step with only launch L inside the profiler range")
    s.add_argument("--preset", default="shard8", choices=PRESET_NAMES)
    s.add_argument("--tokens", type=int, default=16)
    s.add_argument("--ctx", type=int, default=2048)
    s.add_argument("--launch", type=int, default=31, help="the mega launch to profile (31: a middle layer of shard8)")
    s.add_argument("--variant", action="append", help="as for `ab`; default: the repository's kernel")
    s.add_argument("--batch", type=int, default=1, help="B requests of --tokens each in the step (the batch "
                                                        "curve's; past 16 rows in row groups)")
    s.set_defaults(fn=_ncu_mega)
    s = sub.add_parser("ncu-stalls", help="markdown summary of ncu SASS stall samples (no GPU)")
    s.add_argument("csv")
    s.add_argument("--top", type=int, default=12, help="execution-count classes shown")
    s.add_argument("--hottest", type=int, default=20, help="instructions shown")
    s.add_argument("--kernel", help="name or 0-based position, when the file holds several kernels")
    s.add_argument("--out", help="write the markdown here instead of printing it")
    s.add_argument("--listing", help="`nvdisasm -gi -c` output of the profiled build: adds samples per source line")
    s.add_argument("--preset", help="rebuild the profiled megakernel here (needs nvdisasm): adds samples per "
                                     "source line")
    s.add_argument("--variant", help="with --preset: the profiled build as an `ab` variant spec (default: the "
                                      "repository's kernel)")
    s.add_argument("--sm", type=int, default=132, help="with --preset: the profiled GPU's SM count")
    s.add_argument("--tokens", type=int, default=16, help="with --preset: the tree size the profiled build is "
                                                         "for (ncu-mega's --tokens)")
    s.add_argument("--top-source", type=int, default=25, help="source positions shown")
    s.set_defaults(fn=_ncu_stalls)
    s = sub.add_parser("ab", help="in-run A/B of kernel variants on a GPU (--build-only: compile them here)")
    s.add_argument("--variant", action="append", required=True,
                   help="NAME[=CSRC_DIR][:KEY=VALUE,...]; the first is the baseline")
    s.add_argument("--point", action="append", help=f"PRESET:T:CTX, or PRESET:T:CTX:B for B requests a step "
                                                    f"(default {' '.join(AB_POINTS)})")
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--sm", type=int, default=132, help="--build-only: the grid to plan for")
    s.add_argument("--build-only", action="store_true", help="compile every variant into the kernel cache")
    s.add_argument("--out", help="also write the markdown table here")
    s.add_argument("--save", nargs="?", const="", default=None, metavar="DIR",
                   help="also save the typed result (megakernel.ab) under DIR (default reports/results)")
    s.set_defaults(fn=_ab)
    s = sub.add_parser("ab-table", help="the markdown table of a saved megakernel.ab result (no GPU)")
    s.add_argument("result", help="a saved megakernel.ab result file")
    s.add_argument("--out", help="also write the markdown table here")
    s.set_defaults(fn=_ab_table)
    for name, what in PASSTHROUGH.items():
        s = sub.add_parser(name, help=what, add_help=False, prefix_chars="\0")  # its own parser reads every argument
        s.add_argument("args", nargs=argparse.REMAINDER)
        s.set_defaults(fn=_passthrough)


# tools with a parser of their own: `megabench mk NAME ARGS` is `python -m megakernel.MODULE ARGS`
PASSTHROUGH = {
    "peer-bench": "on a GPU: the peer baseline at every point (sweep, torch.compile, per-kernel accounting)",
    "baselines": "on a GPU: the torch baselines of the decode step (model.baselines)",
    "precompile": "compile every build the pipeline and the GPU tests ask for into the kernel cache (no GPU)",
    "fp8-budget": "the FP8 weights' error budget against the bf16 reference (CPU)",
}


def _passthrough(a) -> int:
    prog = f"megabench mk {a.tool}"
    if a.tool == "peer-bench":
        from . import peer_bench as mod  # heavy: torch
    elif a.tool == "baselines":
        from . import bench_baselines as mod  # heavy: torch
    elif a.tool == "precompile":
        from . import precompile as mod  # heavy: torch (megakernel.plan)
    else:
        from . import fp8_budget as mod  # heavy: torch
    return mod.main(a.args, prog=prog)


def run_tool(a, prog: str = "python -m megakernel.cli") -> int:
    """Run the tool parsed into `a`: its exit code; 2 with the message for a MegabenchError (bad
    input, no GPU, a failed check) or an output folder that is not there."""
    try:
        check_writable(getattr(a, "out", None))  # a typo'd output folder: refused before the work
        return a.fn(a)
    except MegabenchError as e:
        print(f"{prog} {a.tool}: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megakernel.cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tools(p.add_subparsers(dest="tool", required=True, metavar="TOOL"))
    return run_tool(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
