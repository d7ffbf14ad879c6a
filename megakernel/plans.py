"""The megakernel's builds as the project runs them: the tuned constants a build reads (`tuned`:
the adopted revision), the plan of each preset from them (`plan_for`), the technique switches and
the ablation's variants, the points the checks and timings use (QUICK, FULL, CHECK_POINTS), the
tolerance against the reference (REL_TOL), and the profiled launches the timeline samples.

Invariant: every build the project measures comes from `plan_for`, so a result names the constants
revision its build read (`constants_env`). Nothing here needs a GPU: `plan_for` takes n_sm.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

from microbench.adopt import has_adoption, load_adopted
from microbench.device import device_info, gpu_count
from microbench.errors import KernelDoesNotFitError
from microbench.results import REPO_ROOT, Env
from microbench.tune import DEFAULTS_ENV, NoConstantsFileError, TunedConstants, load_constants

from .config import ConfigError, ModelConfig
from .config import preset as get_preset
from .plan import MAX_ROW_GROUPS, Plan, fuses_experts, make_plan

QUICK = {"small": [(1, 512), (16, 512)], "shard8": [(1, 2048), (16, 2048)]}
FULL = {"small": [(t, c) for c in (512, 4096) for t in (1, 16)],
        "shard8": [(t, c) for c in (2048, 8192) for t in (1, 16)]}
CHECK_POINTS = {"tiny": [(1, 0), (16, 20), (16, 100)], "small": [(1, 300), (16, 1500)],
                "shard8": [(1, 300), (16, 2500)]}
REL_TOL = 1e-2  # bf16 activations between ops, fp32 accumulation: observed ~3e-3 on tiny
# Batched steps (megakernel.batch) the full run and the benchmark cases time, (B, T, ctx) at the
# headline contexts: B = 2, 4, 8 at T = 1, the B x T = 16 points one m16 token tile holds (B = 2
# T = 8, B = 4 T = 4), and the study's T = 16 trees at B = 2, 4, 8 (32..128 rows: row groups,
# groups.GroupEngine). B = 1 is FULL's own T = 1 and T = 16 at the same contexts
BATCH_GRID = ((2, 1), (4, 1), (8, 1), (2, 8), (4, 4), (2, 16), (4, 16), (8, 16))
BATCH_FULL = {"small": [(b, t, 512) for b, t in BATCH_GRID], "shard8": [(b, t, 2048) for b, t in BATCH_GRID]}


def rows_switches(cfg, rows: int) -> dict:
    """make_plan's switches for the build a step of `rows` token rows runs: up to max_tree rows the
    build for that many (tokens); past it row groups of max_tree rows (Plan.row_groups), as many
    as the rows fill (requests of a tree size dividing max_tree pack into them whole), their routed
    experts over the union of the groups' routing (make_plan's default with row groups)."""
    if not isinstance(rows, int) or rows < 1:
        raise ConfigError(f"{rows!r} token rows: want a positive count")
    if rows <= cfg.max_tree:
        return {"tokens": rows}
    groups = -(-rows // cfg.max_tree)
    if groups > MAX_ROW_GROUPS:
        raise ConfigError(f"{rows} token rows: row groups of {cfg.max_tree} hold at most "
                          f"{MAX_ROW_GROUPS * cfg.max_tree} (Plan.row_groups up to {MAX_ROW_GROUPS})")
    return {"tokens": cfg.max_tree, "row_groups": groups}


# The tuned spin bound covers latency-bound waits only (its rule says so); a megakernel block also
# waits on a producer's whole compute phase, at most one step. 1 s stays far above any step here
# (< 30 ms on the H200) and under compute-sanitizer, yet still turns a hang into a report.
PHASE_ALLOWANCE_NS = 1_000_000_000


def tuned(constants=None):
    """The tuned constants a build reads: the revision adopted for this GPU (microbench/adopt.py:
    reports/constants/adopted/<gpu>.json, changed only with a measurement of the build), never
    straight from whatever `megabench tune` wrote last. MEGABENCH_CONSTANTS=<revision file> builds
    from a candidate revision instead (to measure it before adopting it; results record which), as
    load_constants reads it (=defaults: the documented defaults). Without an adoption: with a GPU
    present, only its own model's current file (constants never cross GPU models), with a warning
    that no measurement adopted it; a GPU without one is an error naming the GPUs that have one.
    Without a GPU (precompiling, CI) the single adoption, else the folder's single file; several
    are an error naming them, and only a folder with no constants file at all falls back to the
    defaults, with a warning. A malformed file raises ResultsFileError naming the problem."""
    if constants is not None:
        return constants


    gpu = device_info().name if gpu_count() else None
    cand = os.environ.get("MEGABENCH_CONSTANTS")
    if cand and cand != DEFAULTS_ENV:  # a candidate revision, to measure it before adopting it
        return load_constants(cand, gpu=gpu)
    if not cand and has_adoption(gpu):
        return load_adopted(gpu)
    try:
        c = load_constants(gpu=gpu)
    except NoConstantsFileError as e:
        if gpu is not None:
            raise
        warnings.warn(f"{e}; the megakernel builds with the documented defaults", stacklevel=2)
        return TunedConstants.defaults()
    if not os.environ.get("MEGABENCH_CONSTANTS"):
        warnings.warn(f"no adopted constants revision for {gpu or 'this machine'}: building from the current file "
                      f"{c.path} (revision {c.revision}), which no measurement of this build adopted", stacklevel=2)
    return c


def constants_env(env=None, constants=None):
    """`env` (default Env.capture()) recording which constants revision the build read."""

    c = tuned(constants)
    env = env if env is not None else Env.capture()
    path = getattr(c, "path", None)
    if path:
        try:
            path = str(Path(path).resolve().relative_to(REPO_ROOT))
        except ValueError:
            pass
    return dataclasses.replace(env, constants_revision=getattr(c, "revision", None),
                               constants_file=path or "documented defaults")


def _get(constants, key):
    return constants[key] if isinstance(constants, dict) else getattr(constants, key)


# Per-role register budgets (Plan.compute_registers): the compute warps take 224 registers, the
# loader's warpgroup keeps 56. Bound: a block of 12 warps (8 compute, the loader's 4) then holds
# 32 x (8 x 224 + 4 x 56) = 64512 of the SM's 65536 registers, so a larger compute budget needs a
# smaller loader one. Invariant: no default build spills at this budget (the slow CPU test
# test_preset_kernels_compile_for_sm90a_without_spills fails on any spill). The A/Bs behind the
# number are in the lever index (LEVERS.md).
ROLE_REGISTERS = 224


def plan_for(preset: str | ModelConfig, constants=None, n_sm: int | None = None, **switches) -> Plan:
    """Plan from the tuned constants (documented defaults where no constants file exists). `preset`:
    a preset's name, or a model config of the family (the drafter's, draft.draft_model_config:
    the same tuned constants build it, it has none of its own)."""

    cfg = preset if isinstance(preset, ModelConfig) else get_preset(preset)
    preset = cfg.name
    n_sm = n_sm or device_info().sm_count
    c = tuned(constants)
    # the tuned ring is the least that streams at full rate; spare shared memory adds stages of
    # its size (plan.make_plan fill_ring)
    kw = dict(ring_stages=int(_get(c, "ring_stages")), ring_stage_bytes=int(_get(c, "ring_stage_bytes")),
              spin_bound_ns=int(_get(c, "spin_bound_ns")) + PHASE_ALLOWANCE_NS,
              poll_backoff_ns=int(_get(c, "poll_backoff_ns")), fill_ring=True,
              # weights.l2 measured whether an evict-first stream keeps reused data in L2
              stream_evict_first=bool(int(_get(c, "evict_first_pays"))),
              # clocks.launch measured whether PDL shortens a chain of persistent launches
              pdl=bool(int(_get(c, "pdl_pays"))),
              # sync.publish measured whether sentinel slots beat a release flag for small payloads
              # (the router's logits are 512 B per unit at shard8 T=16)
              sentinel_route=bool(int(_get(c, "sentinel_pays"))),
              # the fused expert unit wherever the model's shapes allow it (plan.fuses_experts; its
              # A/B against the split GEMMs is in the lever index)
              fused_experts=fuses_experts(cfg),
              compute_registers=ROLE_REGISTERS)
    kw.update(switches)  # a technique switch overrides the constant
    if "fused_experts" not in switches and kw["fused_experts"]:
        try:  # the default only: a unit of too few gate rows for a K-part builds the split GEMMs
            make_plan(cfg, n_sm, **kw)
        except ValueError as e:
            if "fused_experts" not in str(e):
                raise
            kw["fused_experts"] = False
    try:
        return make_plan(cfg, n_sm, **kw)
    except KernelDoesNotFitError as e:
        warnings.warn(f"{preset}: the tuned ring does not fit ({e}); building with the default ring", stacklevel=2)
        kw.pop("ring_stages"), kw.pop("ring_stage_bytes")
        return make_plan(cfg, n_sm, **kw)


def code_budget(constants=None) -> int:
    return int(_get(tuned(constants), "max_code_bytes_per_launch"))


# ---------------------------------------------------------------------- techniques
def technique_switches(constants=None, n_sm: int = 132) -> dict[str, dict]:
    """Each technique as plan switches. The "all" build uses every one; the ablation switches one
    on at a time (from none) and one off at a time (from all)."""
    return {"loader_ahead": {"loader_ahead": True}, "pdl": {"pdl": True},
            "evict_first": {"stream_evict_first": True}, "sentinel": {"sentinel_route": True},
            "role_registers": {"compute_registers": ROLE_REGISTERS}}


NONE = {"loader_ahead": False, "pdl": False, "stream_evict_first": False, "sentinel_route": False,
        "compute_registers": 0}


def ablation_variants(constants=None, n_sm: int = 132) -> dict[str, tuple[dict, str]]:
    """{impl: (plan switches, program mode)}: no technique, all, each one alone, all but each one,
    and all in a single whole-step launch instead of one launch per layer."""
    tech = technique_switches(constants, n_sm)
    allsw = {k: v for d in tech.values() for k, v in d.items()}
    variants = {"mega+none": (NONE, "layer"), "mega+all": (allsw, "layer")}
    for name, sw in tech.items():
        variants[f"mega+only_{name}"] = ({**NONE, **sw}, "layer")
        variants[f"mega+all_but_{name}"] = ({**allsw, **{k: NONE[k] for k in sw}}, "layer")
    variants["mega+all_single_launch"] = ({**allsw, "pdl": False}, "step")  # one launch: nothing to chain
    return variants


def ablation_names() -> list[str]:
    """The ablation's variant names (they do not depend on the constants' values)."""

    return list(ablation_variants(TunedConstants.defaults()))


PRESETS = ("tiny", "small", "shard8")


# the sampled profile the timeline also times: one launch in this many. A prime, so the sample
# does not step with the global-attention layers' regular spacing (shard8: 9 of 63 launches, 2
# of them with a global layer; small: 1 of 13)
PROFILE_SAMPLE_EVERY = 7


def middle_launch(n_launch: int) -> int:
    """A middle layer's launch (attention of layer L through qkv of L + 1): the one the timeline
    traces and samples around."""
    return n_launch // 2


def profile_samples(n_launch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The two sampled profiles the timeline times (Engine.profile_launches): one launch in
    PROFILE_SAMPLE_EVERY through the middle launch, and as many consecutive launches around it.
    The window switches between the profiled and the unprofiled build twice a step instead of
    twice per recorded launch (each switch costs microseconds of its own)."""
    mid = middle_launch(n_launch)
    spread = tuple(range(mid % PROFILE_SAMPLE_EVERY, n_launch, PROFILE_SAMPLE_EVERY))
    lo = max(0, min(mid - len(spread) // 2, n_launch - len(spread)))
    return spread, tuple(range(lo, lo + len(spread)))


def slot_units(plan: Plan) -> dict[str, int]:
    """Units of one routed slot per routed op: gate/up units of d_expert / (a unit's gate rows),
    down-projection units of d_pool / (a unit's rows) (program.cuh EXP1_TILES, EXP2_TILES)."""
    c = plan.cfg
    e1 = c.d_expert // (plan.tiles["expert1"].rows // 2)
    return {"expert1": e1, "expert2": e1 if plan.fused_experts else c.d_pool // plan.tiles["expert2"].rows}
