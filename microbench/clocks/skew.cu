// SM-to-SM skew: stampers released by one flag write stamp %globaltimer and %clock64.
//
// Roles (block of 64 threads = 2 warps):
//   stamper  = thread 0 of every block: per trial k = 1..trials, arrive (counter += 1), poll the
//              release flag until it reaches k, then immediately read %globaltimer and %clock64.
//   releaser = thread 32 (warp 1) of block 0, only where `releaser` != 0: waits until all
//              `expected` stampers of trial k have arrived, waits a pseudo-random number of
//              %clock64 cycles (so the release lands at a random phase of the globaltimer tick),
//              then stores k to the flag.
// The flag and counter may live on another GPU (peer memory) or in host memory: with
// sys_scope != 0 every access is system scope, and several grids (one per GPU) can share one
// flag, with `expected` counting the stampers of all of them and exactly one grid releasing.
// That is how GPU-to-GPU skew reuses this kernel unchanged.
//
// Deadlock: every stamper must be resident, or the releaser waits for an arrival that never
// comes; the host checks co-residency, and every wait is bounded (mb/spin.cuh): a stamper or
// releaser that gives up records why in the watchdog record and ends the kernel.
// The host launches one block per SM (dynamic smem sized so that no two fit on one SM).
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"

enum SkewWait : uint32_t { SKEW_WAIT_RELEASE = 1u, SKEW_WAIT_ARRIVALS = 2u };

extern "C" __global__ void __launch_bounds__(64) clk_skew(uint32_t* release_flag, uint32_t* arrive, uint32_t expected,
                                                          uint32_t trials, uint32_t releaser, uint32_t sys_scope,
                                                          uint32_t min_delay_cycles, uint32_t jitter_cycles,
                                                          unsigned long long* gt_out, unsigned long long* c64_out,
                                                          uint32_t* sm_out, unsigned long long* wd_rec,
                                                          unsigned long long bound_ns) {
  const mb::Watchdog w{wd_rec, bound_ns};
  const uint32_t nb = gridDim.x;
  const uint32_t b = blockIdx.x;
  if (threadIdx.x == 0) {
    sm_out[b] = mb::smid();
    for (uint32_t k = 1; k <= trials; ++k) {
      // arrival k says "polling for trial k"; release order puts my trial k-1 stores before it
      if (sys_scope) mb::atom_add_release_sys(arrive, 1u);
      else mb::atom_add_release_gpu(arrive, 1u);
      const bool ok = sys_scope ? mb::spin_geq_sys(w, release_flag, k, SKEW_WAIT_RELEASE)
                                : mb::spin_geq(w, release_flag, k, SKEW_WAIT_RELEASE);
      const uint64_t t = mb::globaltimer();  // first thing after the flag is seen: globaltimer, then clock64
      const uint64_t c = mb::clock64();
      if (!ok) return;
      gt_out[static_cast<size_t>(k - 1) * nb + b] = t;
      c64_out[static_cast<size_t>(k - 1) * nb + b] = c;
    }
  } else if (threadIdx.x == 32 && b == 0 && releaser != 0u) {
    uint32_t lcg = 0x9E3779B9u;
    for (uint32_t k = 1; k <= trials; ++k) {
      const uint32_t target = k * expected;  // host checks trials * expected < 2^31
      const bool ok = sys_scope ? mb::spin_geq_sys(w, arrive, target, SKEW_WAIT_ARRIVALS)
                                : mb::spin_geq(w, arrive, target, SKEW_WAIT_ARRIVALS);
      if (!ok) return;
      lcg = lcg * 1664525u + 1013904223u;
      const uint64_t delay = min_delay_cycles + (jitter_cycles ? (lcg >> 8) % jitter_cycles : 0u);
      const uint64_t c0 = mb::clock64();
      while (mb::clock64() - c0 < delay) {
      }  // bounded: clock64 always advances
      if (sys_scope) mb::st_release_sys(release_flag, k);
      else mb::st_release_gpu(release_flag, k);
    }
  }
}
