"""The megakernel's profiler events (device API: microbench/cuda/mb/profile.cuh).

Per block, thread 0 (lane 0 of compute warp 0) stamps for every op instance it has units of:
  wait_<op>   from reaching the op to its first unit's dependencies being satisfied
  <op>        from then to the end of its last unit (later units' waits fold in here)
and `launch_start` / `launch_end` instants; arg = the op instance index (program.py), so a stamp
names its layer too. With Plan.profile_detail, thread 0 also stamps inside the units:
  stage       staging an activation operand into shared memory (arg: 0 norm, 1 rows)
  ring_wait   waiting for a weight chunk to land in the ring (arg: the ring chunk number)
  attn_load   attention's Q and K/V loads of a round, to the barrier after them (arg: round)
  publish     releasing a done-counter (the release waits for the block's stores to drain)
  fp4_tail    an expert GEMM unit's last chunk done (thread 0) to the barrier after every warp's
              results (the slowest warp's lag)
  epilogue    an expert unit's epilogue, to its stores issued
  unit_open   a unit's dependency wait (thread 0) and the barrier that starts the unit; not for an
              op's first unit on the block (that opening is the op's wait phase), nor for a unit
              that does not open (program.cuh unit_opens: nothing to wait for)
  unit_close  the barrier that ends a unit and thread 0's signal bookkeeping after it
  topk_step   top-k's steps after its poll (arg: 0 selections, 1 reset + softmax, 2 slots)
which the host assigns to the <op> phase around them (pipeline.detail_by_op). Without detail
stamps, thread 0 only saves each op's instants and the compute warps write the op records
together later (program.cuh prof_flush): same records, off the critical path. The rendered
header is part of every megakernel build; with Plan.profile false the stamps compile to nothing
(mb/profile.cuh)."""
from __future__ import annotations

from microbench.clocks.profiler import ProfileEvents

from .plan import OP_KINDS

EVENTS = ProfileEvents("megakernel", prefix="MK_EV", doc="megakernel: per-block op phases (arg = op index)")
EVENTS.instant("launch_start", "block entered the kernel (arg = first op of the launch)")
for _k in OP_KINDS:
    EVENTS.phase(f"wait_{_k}", f"waiting for the dependencies of the block's first {_k} unit")
    EVENTS.phase(_k, f"the block's {_k} units")
EVENTS.instant("launch_end", "block finished its last unit (arg = first op of the launch)")
# detail phases (Plan.profile_detail), after the per-op block so its arithmetic layout is unchanged
EVENTS.phase("stage", "staging an activation operand into shared memory (0 norm, 1 rows)")
EVENTS.phase("ring_wait", "thread 0 waiting for a weight chunk in the ring (arg = chunk number)")
EVENTS.phase("attn_load", "attention: a round's K/V rows (and, in round 0, the Q rows) loaded into shared "
                          "memory, to the barrier after (arg = round)")
EVENTS.phase("publish", "thread 0 releasing an op's or group's done-counter: waits for the block's stores "
                        "to reach L2 (arg: 0 the op's counter, 1 a group's)")
EVENTS.phase("fp4_tail", "expert GEMM: thread 0's last chunk done to every warp's results in shared memory "
                         "(the barrier after them: the slowest warp's lag)")
EVENTS.phase("epilogue", "expert GEMM: the unit's epilogue, from the results in shared memory to its stores "
                         "issued (before the unit's closing barrier)")
EVENTS.phase("unit_open", "a unit's dependency wait on thread 0 and the barrier that starts the unit, from the "
                          "block's second unit of an op on (the first's is the op's wait phase) and only where "
                          "the unit opens (program.cuh unit_opens; arg = unit)")
EVENTS.phase("unit_close", "the barrier that ends a unit and thread 0's signal bookkeeping (arg = unit)")
TOPK_STEPS = ("the selections", "the logits' reset and the softmax with its stores, to the barrier after",
              "the slots: expert bitmap, prefix, slot records")  # topk_step's arg (ops/topk.cuh stamps 0, 1, 2)
EVENTS.phase("topk_step", "top-k's steps after its poll (arg: " + ", ".join("%d %s" % (i, s) for i, s in enumerate(TOPK_STEPS))
             + "); thread 0's view, which runs tokens 0 and 8")
DETAIL_PHASES = ("stage", "ring_wait", "attn_load", "publish", "fp4_tail", "epilogue", "unit_open", "unit_close",
                 "topk_step")


def render_op_tables() -> str:
    """The device finds an op kind's events by arithmetic (csrc/mk/program.cuh): wait_<k>_begin =
    wait_embed_begin + 4 k, <k>_begin = wait_<k>_begin + 2, ends one after their begins. These
    static_asserts pin that layout, so a change in the registry order fails the build."""
    out = []
    first = EVENTS.macro("wait_embed_begin")
    for i, k in enumerate(OP_KINDS):
        w, b = EVENTS.macro(f"wait_{k}_begin"), EVENTS.macro(f"{k}_begin")
        out.append(f'static_assert({w} == {first} + 4 * {i} && {b} == {w} + 2 && '
                   f'{EVENTS.macro(f"{k}_end")} == {b} + 1, "profiler ids of {k}");')
    return "\n".join(out) + "\n"
