// Instrumentation cost: a realistic persistent kernel with and without per-phase profiler stamps.
//
// x holds PHASES + 1 buffers of gridDim.x * per_block u32 words. In phase p every block b waits
// until block src = (b + p + 1) % nblocks has finished phase p - 1 (per-producer flag), reads
// src's slice of buffer p through L2, applies v * a_p + c_p (mod 2^32) and writes its own slice
// of buffer p + 1, then publishes flags[b] = p + 1. Memory-bound, with real cross-block
// dependencies, like a layer of a decode megakernel.
//
// Stamps: lane 0 of warp 0 records wait begin/end and compute begin/end of every phase, plus
// INSTR_STAMP_REPEAT - 1 extra "mark" stamps after each (the cost-versus-stamp-count slope).
// Compiled with MB_PROFILE=0 the stamps vanish; the output must be bitwise identical either way.
// INSTR_BROKEN=1 skips the last 16 bytes of every block's final slice: the checker must fail.
//
// Deadlock: a block waits on another block's flag, so the grid must be co-resident (the host
// checks); the waits are bounded (mb/spin.cuh) and report which flag they gave up on.
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"
#include "mb/profile.cuh"
#include "gen/clocks_instr_events.cuh"

#ifndef INSTR_PHASES
#define INSTR_PHASES 4
#endif
#ifndef INSTR_STAMP_REPEAT
#define INSTR_STAMP_REPEAT 1
#endif
#ifndef INSTR_BROKEN
#define INSTR_BROKEN 0
#endif
#ifndef INSTR_THREADS
#define INSTR_THREADS 256
#endif
static_assert(INSTR_STAMP_REPEAT >= 1, "INSTR_STAMP_REPEAT counts the stamps per event (>= 1)");

#define INSTR_STAMP(ev, p)                                                                   \
  do {                                                                                       \
    prof.stamp((ev), (p));                                                                   \
    for (int r_ = 1; r_ < INSTR_STAMP_REPEAT; ++r_) prof.stamp(CLK_INSTR_EV_MARK, (p));      \
  } while (0)

__device__ __forceinline__ uint32_t madd(uint32_t v, uint32_t a, uint32_t c) { return v * a + c; }

// per_block: u32 words per block slice, a multiple of 4 (16-byte vectors).
extern "C" __global__ void __launch_bounds__(INSTR_THREADS) clk_instr(uint32_t* x, uint32_t per_block, uint32_t* flags,
                                                                      const uint32_t* coef, unsigned long long* wd_rec,
                                                                      unsigned long long bound_ns, MB_PROF_PARAMS) {
  mb::prof::Profiler prof(MB_PROF_ARGS);
  const mb::Watchdog w{wd_rec, bound_ns};
  __shared__ uint32_t s_ok;
  const uint32_t nb = gridDim.x;
  const uint32_t b = blockIdx.x;
  const size_t n = static_cast<size_t>(nb) * per_block;
  const uint32_t n4 = per_block / 4u;
  for (uint32_t p = 0; p < INSTR_PHASES; ++p) {
    const uint32_t src = (b + p + 1u) % nb;
    if (p > 0) {
      INSTR_STAMP(CLK_INSTR_EV_WAIT_BEGIN, p);
      if (threadIdx.x == 0) s_ok = mb::spin_geq(w, &flags[src], p, /*what=*/src) ? 1u : 0u;
      __syncthreads();  // thread 0's acquire, then this barrier, orders everyone's reads after src's writes
      INSTR_STAMP(CLK_INSTR_EV_WAIT_END, p);
      if (!s_ok) return;  // uniform: a producer never published; the watchdog record names it
    }
    INSTR_STAMP(CLK_INSTR_EV_COMPUTE_BEGIN, p);
    const uint4* in = reinterpret_cast<const uint4*>(x + p * n + static_cast<size_t>(src) * per_block);
    uint4* out = reinterpret_cast<uint4*>(x + (p + 1) * n + static_cast<size_t>(b) * per_block);
    const uint32_t a = coef[2 * p], c = coef[2 * p + 1];
    const uint32_t end = n4 - ((INSTR_BROKEN && p == INSTR_PHASES - 1) ? 1u : 0u);
#pragma unroll 4
    for (uint32_t i = threadIdx.x; i < end; i += blockDim.x) {
      uint4 v = mb::ld_cg_v4(in + i);  // L2: the producer ran on another SM
      v.x = madd(v.x, a, c);
      v.y = madd(v.y, a, c);
      v.z = madd(v.z, a, c);
      v.w = madd(v.w, a, c);
      out[i] = v;
    }
    __syncthreads();  // every thread's stores happen before thread 0's release below; s_ok reuse is safe
    INSTR_STAMP(CLK_INSTR_EV_COMPUTE_END, p);
    if (threadIdx.x == 0) {
      __threadfence();
      mb::st_release_gpu(&flags[b], p + 1u);
    }
  }
}
