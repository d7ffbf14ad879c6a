// Grid-wide waits in a persistent grid of one block per SM (benchmark sync.barriers).
//
// Every block runs `stops` sync stops with no work between them; thread 0 times the whole loop
// with %clock64 (and %globaltimer). Cost per stop = cycles / stops, minus the empty loop (BM_NONE).
//   BM_GRIDSYNC  cooperative groups grid.sync()
//   BM_ATOMIC    one monotonic arrival counter: stop e (absolute) is passed once the counter
//                reaches (e + 1) * blocks; never reset, so no reset race between epochs
//   BM_DEPFLAGS  each block release-stores its own monotonic flag (e + 1) and waits only for the
//                D producers it depends on (a per-block list)
//   BM_DEPFLAGS_NOWAIT  the same without the waits: broken on purpose (the checker must fail)
// Verify mode: before stop e each block writes e into data[e & 1][block]; after the stop it reads
// its producers' (barrier modes: the next block's) words: exactly e after a barrier, >= e after
// a dependency wait (a producer may be further ahead). Mismatches are counted and the first is
// recorded. A delay injected into one block at one stop makes a missing wait visible for sure.
// The launch is always cooperative (co-residency of every block is guaranteed or refused);
// every spin is bounded by the watchdog.
#include <cooperative_groups.h>
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"
#include "sync_common.cuh"

namespace cg = cooperative_groups;
using namespace mbsync;

enum BRParam : int {
  BR_MODE = 0,
  BR_STOPS,
  BR_BASE,         // absolute index of the first stop (counters and flags continue across launches)
  BR_COUNTER,      // u32* arrival counter (BM_ATOMIC)
  BR_FLAGS,        // u32* per-block flags, 32-word stride (BM_DEPFLAGS)
  BR_DEPS,         // u32 [blocks][D] producer lists
  BR_D,
  BR_DATA,         // u32 [2][blocks] verify words
  BR_VERIFY,
  BR_ERRORS,       // u32 [4]: count, first block, first stop, value seen
  BR_OUT,          // u64 [blocks][BO_FIELDS]
  BR_WD,
  BR_BOUND_NS,
  BR_DELAY_BLOCK,  // block that stalls (verify tests), or NONE
  BR_DELAY_STOP,
  BR_DELAY_NS,
  BR_NPARAMS
};
enum BRMode : int { BM_NONE = 0, BM_GRIDSYNC = 1, BM_ATOMIC = 2, BM_DEPFLAGS = 3, BM_DEPFLAGS_NOWAIT = 4, BM_MODES };
enum BROut : int { BO_SMID = 0, BO_CYCLES, BO_GT_START, BO_GT_END, BO_STATUS, BO_FIELDS };
enum BRStatus : int { BS_NOT_RUN = 0, BS_OK = 1, BS_TIMEOUT = 2, BS_BAD_ARGS = 3 };
constexpr uint32_t BR_MAX_D = 1024;  // producers per block (shared-memory list)

extern "C" __global__ void __launch_bounds__(128, 1) sync_grid_wait(const uint64_t* P) {
  MB_INJECT_SCOPE();  // the gate's calibrated slowdown (mb/inject.cuh)
  __shared__ int fail_s;
  cg::grid_group grid = cg::this_grid();
  const uint32_t mode = static_cast<uint32_t>(P[BR_MODE]), stops = static_cast<uint32_t>(P[BR_STOPS]);
  const uint32_t base = static_cast<uint32_t>(P[BR_BASE]), D = static_cast<uint32_t>(P[BR_D]);
  const uint32_t G = gridDim.x, b = blockIdx.x, tid = threadIdx.x;
  const bool verify = P[BR_VERIFY] != 0;
  uint32_t* counter = reinterpret_cast<uint32_t*>(P[BR_COUNTER]);
  uint32_t* flags = reinterpret_cast<uint32_t*>(P[BR_FLAGS]);
  uint32_t* data = reinterpret_cast<uint32_t*>(P[BR_DATA]);
  uint32_t* errors = reinterpret_cast<uint32_t*>(P[BR_ERRORS]);
  uint64_t* out = reinterpret_cast<uint64_t*>(P[BR_OUT]) + static_cast<size_t>(b) * BO_FIELDS;
  const mb::Watchdog w{reinterpret_cast<unsigned long long*>(P[BR_WD]), P[BR_BOUND_NS]};
  // Everything the loop needs is read once here: a global load inside the loop would be an L2
  // round trip per stop (every acquire poll invalidates L1), inflating the measured cost.
  const uint32_t delay_block = static_cast<uint32_t>(P[BR_DELAY_BLOCK]), delay_stop = static_cast<uint32_t>(P[BR_DELAY_STOP]);
  const uint64_t delay_ns = P[BR_DELAY_NS];
  const bool dep_mode = mode == BM_DEPFLAGS || mode == BM_DEPFLAGS_NOWAIT;
  if (mode >= BM_MODES || (dep_mode && (D == 0 || D > BR_MAX_D))) {
    if (tid == 0) out[BO_STATUS] = BS_BAD_ARGS;
    return;  // uniform over the grid: nobody waits for anybody
  }
  // this block's producers, in shared memory (thread t waits for producers t, t + blockDim, ...)
  __shared__ uint32_t deps_s[BR_MAX_D];
  if (dep_mode)
    for (uint32_t j = tid; j < D; j += blockDim.x) deps_s[j] = reinterpret_cast<const uint32_t*>(P[BR_DEPS])[b * D + j];
  if (tid == 0) fail_s = 0;
  __syncthreads();
  uint64_t c0 = 0, g0 = 0;
  if (tid == 0) {
    c0 = mb::clock64();
    g0 = mb::globaltimer();
  }
  uint32_t polls = 0;
  for (uint32_t s = 0; s < stops; ++s) {
    const uint32_t e = base + s;
    if (verify && tid == 0) mb::st_relaxed_gpu(&data[(e & 1u) * G + b], e);
    if (b == delay_block && s == delay_stop && tid == 0) {
      const uint64_t t = mb::globaltimer();
      while (mb::globaltimer() - t < delay_ns) mb::nanosleep(1000);  // bounded by delay_ns itself
    }
    if (mode == BM_GRIDSYNC) {
      grid.sync();
    } else if (mode == BM_ATOMIC) {
      __syncthreads();
      if (tid == 0) {
        mb::red_add_release_gpu(counter, 1u);
        if (!mb::spin_geq(w, counter, (e + 1u) * G, what_id(SW_BARRIER, s))) fail_s = 1;
      }
      __syncthreads();
    } else if (dep_mode) {
      __syncthreads();  // the block's work for stop e is done before the flag says so
      if (tid == 0) mb::st_release_gpu(&flags[static_cast<size_t>(b) * 32], e + 1u);
      if (mode == BM_DEPFLAGS)
        for (uint32_t j = tid; j < D; j += blockDim.x)
          if (!poll_geq<Scope::gpu, POLL_ACQ>(w, &flags[static_cast<size_t>(deps_s[j]) * 32], e + 1u, what_id(SW_DEP, s), 0,
                                              polls))
            fail_s = 1;
      __syncthreads();
    } else {
      __syncthreads();
    }
    if (verify) {
      uint32_t bad = 0, v = 0;
      if ((mode == BM_GRIDSYNC || mode == BM_ATOMIC) && tid == 0) {
        v = mb::ld_relaxed_gpu(&data[(e & 1u) * G + (b + 1u) % G]);
        bad = v != e;
      } else if (dep_mode) {
        for (uint32_t j = tid; j < D && !bad; j += blockDim.x) {
          v = mb::ld_relaxed_gpu(&data[(e & 1u) * G + deps_s[j]]);
          bad = static_cast<int32_t>(v - e) < 0;
        }
      }
      if (bad && atomicAdd(&errors[0], 1u) == 0u) {
        errors[1] = b;
        errors[2] = s;
        errors[3] = v;
      }
    }
    if (fail_s) break;  // read after a __syncthreads in every mode that can fail
  }
  __syncthreads();
  if (tid == 0) {
    out[BO_SMID] = mb::smid();
    out[BO_CYCLES] = mb::clock64() - c0;
    out[BO_GT_START] = g0;
    out[BO_GT_END] = mb::globaltimer();
    out[BO_STATUS] = fail_s ? BS_TIMEOUT : BS_OK;
  }
}

extern "C" __global__ void sync_barrier_heat(unsigned long long ns, float* sink) {
  const float x = heat_body(ns);
  if (x == 12345.0f) sink[0] = x;
}
