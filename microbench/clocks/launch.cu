// Launch-to-launch: a persistent-style kernel launched back to back (plain, or with programmatic
// dependent launch). Each block stamps when it lands on its SM (its first instruction), when
// griddepcontrol.wait returns (the previous grid has completed and flushed; a no-op without
// PDL), and when its busy work ends (just before it exits). The host compares the blocks of
// launch k+1 with the exits of launch k, per SM and against the whole grid.
//
// The work is a %globaltimer-timed busy loop of work_ns + (block % 8) * jitter_ns, so blocks
// leave at staggered times as in a real layer; it is bounded by an iteration count too.
// Dynamic shared memory (set by the host) decides whether a block of k+1 can share an SM with
// a block of k: with more than half the SM's shared memory it cannot land before k's block
// on that SM leaves.
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/profile.cuh"
#include "gen/clocks_launch_events.cuh"

extern "C" __global__ void clk_chain(unsigned long long work_ns, unsigned long long jitter_ns, uint32_t* sink,
                                     MB_PROF_PARAMS) {
  MB_INJECT_SCOPE();  // the gate's calibrated slowdown (mb/inject.cuh)
  mb::prof::Profiler prof(MB_PROF_ARGS);
  prof.stamp(CLK_LAUNCH_EV_GRIDDEP_WAIT_BEGIN);
  mb::griddepcontrol_wait();
  prof.stamp(CLK_LAUNCH_EV_GRIDDEP_WAIT_END);
  // Let the next launch schedule its blocks as early as possible: they land wherever resources
  // allow and then wait in griddepcontrol.wait until this grid has completed.
  mb::griddepcontrol_launch_dependents();
  const unsigned long long planned = work_ns + (blockIdx.x % 8u) * jitter_ns;
  prof.stamp(CLK_LAUNCH_EV_WORK_BEGIN, static_cast<uint32_t>(planned));
  const uint64_t t0 = mb::globaltimer();
  uint64_t t = t0;
  uint32_t spins = 0;
  const unsigned long long max_spins = planned + 100000ull;  // >= 1 ns per iteration
  for (unsigned long long i = 0; i < max_spins && t - t0 < planned; ++i) {
    t = mb::globaltimer();
    ++spins;
  }
  if (threadIdx.x == 0) sink[blockIdx.x] = spins;  // keeps the loop observable; read by nobody
  prof.stamp(CLK_LAUNCH_EV_WORK_END, static_cast<uint32_t>(planned));
}
