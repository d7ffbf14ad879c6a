// The megakernel: one persistent launch runs a range of op instances of the decode step.
//
//   mk_run(params, first, n_ops, wait, parity)
//     params: the parameter block of each rank of the launch (Plan.launch_ranks; one without ranks)
//     wait = 1 (mega mode): one block per SM, all co-resident; units of later ops wait on the
//              dependency counters of the units they need (program.cuh), never on a grid barrier.
//     wait = 0 (chain mode): the host launches one op instance per launch, in order; stream order
//              replaces the counters. Same code, same units, same reduction orders: the two
//              modes are bitwise equal by construction, and tests check it.
// Block = WARPS compute warps + 1 loader warp (bulk copies into the shared-memory ring), and with
// per-role register budgets (COMPUTE_REGS) 3 spare warps that complete the loader's warpgroup.
// The step's shape (token rows, requests, each request's context and rows) is not a parameter:
// the compute warps read it from params->step after pdl_wait() (abi.py STEP_FIELDS, load_step),
// so a CUDA graph replays any step and a device loop can advance it. parity (which half of the
// dependency counters this launch uses) stays one: the loader's routing wait reads those counters
// before the previous launch has ended.
// The last two parameters are the profiler's (mb/profile.cuh): (0, 0) records nothing.
// Constants come from megakernel/plan.py (rendered above this file when built; the committed
// default_config.cuh — the tiny preset — lets this file compile on its own).
#ifndef MK_GENERATED
#include "mk/default_config.cuh"
#endif
#include "mk/program.cuh"

// The launch bounds give 9 warps 168 registers each; 12 warps (COMPUTE_REGS) get 168 too, the
// budget setmaxnreg starts from. One block per SM: every block of a launch must be co-resident.
extern "C" __global__ void __launch_bounds__(mk::THREADS, 1)
    mk_run(const mk::Params* __restrict__ params, int first, int n_ops, int wait, int parity,
           MB_PROF_PARAMS) {
  // The regression gate's calibrated slowdown (mb/inject.cuh, `megabench gate --quality-run`): an
  // empty statement unless MB_INJECT_PPM is defined; then the launch's last block spins for that
  // many ppm of its run time once thread 0 is done (after its grid-dependency wait under PDL).
  MB_INJECT_SCOPE();
  using namespace mk;
  // LAYOUT_PAD (Plan.layout_pad), a code-layout placebo for A/Bs: instructions that never run
  // (`first` is never negative) and shift every instruction after them by ~LAYOUT_PAD bytes, so
  // an A/B can show how far the step moves with code layout alone (one NANOSLEEP of a distinct
  // immediate each: the compiler keeps them all)
  if constexpr (LAYOUT_PAD > 0) {
    if (first < 0) {
#pragma unroll
      for (int k = 0; k < LAYOUT_PAD / 16; ++k) backoff(static_cast<unsigned>(k + 1));
    }
  }
  // PDL: the next launch may be scheduled as soon as this one runs; its blocks land on SMs as
  // ours leave (one block per SM), and its compute warps wait for all of this grid below.
  if (PDL) pdl_launch_dependents();
  // The profiler (two pointers, five counters) lives in shared memory and only thread 0 stamps
  // (the layout records warp 0 lane 0 alone). Danger: as registers of every thread it would be
  // live through every op's code and push the profiled build past 168 registers (spills).
  Blk b = make_blk(params + launch_rank(), parity, wait);  // this block's rank's (Plan.launch_ranks)
  mb::prof::Profiler& prof = *reinterpret_cast<mb::prof::Profiler*>(b.misc + MISC_PROF);
  if (tid() == 0) {
    prof = mb::prof::Profiler(MB_PROF_ARGS);
    prof.stamp(MK_EV_LAUNCH_START, first);
    for (int s = 0; s < RING_STAGES; ++s) {
      mbar_init(&b.full[s], 1);
      mbar_init(&b.empty[s], COMPUTE_THREADS);
    }
    mbar_init(b.xbar, 1);
    fence_mbar_init();
    b.misc[MISC_TAG] = -1;
    b.misc[MISC_SLOT + 2] = -1;  // no slot record (program.cuh slot_fetch)
    b.misc[MISC_RTAG] = -1;
    for (int k = 0; k < KEEP_UNITS; ++k) b.misc[MISC_KEEP + k] = -1;
    b.misc[MISC_OPS_DONE] = 0;
    if (PROF_DEFER) {
      for (int k = 0; k < PROF_OPS; ++k) prof_slot(b, k)->op = -1;
      b.misc[MISC_PWIN] = first;
    }
  }
  sync_block();
  // per-role budgets (COMPUTE_REGS): the loader's warpgroup gives registers back, its other 3
  // warps existing only for that (setmaxnreg is per warpgroup), and the compute warps take them.
  // Danger: the dispatch stays one if / else chain whose branches are the 9-warp build's; an `if`
  // around the warp roles' code moves ptxas to a 16 B spill
  if (warp() == WARPS) {
    if constexpr (COMPUTE_REGS > 0) setmaxnreg_dec<LOADER_REGS>();
    loader_loop(b, first, n_ops);  // weights only: never waits for the previous launch
  } else if (COMPUTE_REGS > 0 && warp() > WARPS) {
    setmaxnreg_dec<LOADER_REGS>();  // a spare warp: gives its registers back and leaves
  } else {
    if constexpr (COMPUTE_REGS > 0) setmaxnreg_inc<COMPUTE_REGS>();
    if (PDL) pdl_wait();  // activations, caches, counters and the step block of the previous launch are complete
    load_step(b);
    // launches the host does not record (no buffer) skip the instants and the flush too
    const bool rec = mb_prof_buf != nullptr;
    compute_loop(b, first, n_ops, prof, rec);
    if (rec) prof_flush(b, prof, false);  // the ops since the last flush (all of them after an early stop, too)
    if (tid() == 0) prof.stamp(MK_EV_LAUNCH_END, first);
  }
}
