// Timer probes (microbench/clocks/probes.py): the %globaltimer tick, the %clock64 rate against
// it, and what reading each costs. Every loop here ends on a count as well as on time, so a
// timer that never moves cannot hang the GPU.
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/profile.cuh"
#include "gen/clocks_timers_events.cuh"

#ifndef CLK_READS_PER_ITER
#define CLK_READS_PER_ITER 32
#endif

// Lane 0 of each block reads %globaltimer back to back and logs every change: the increment (ns)
// and %clock64 at the change (update period in cycles). Stops after max_changes changes,
// max_reads reads, or max_ns of globaltimer time. info[b] = {changes, reads, smid, stop reason
// (1 changes, 2 reads, 3 time)}.
extern "C" __global__ void clk_tick_probe(uint32_t max_changes, uint32_t max_reads, unsigned long long max_ns,
                                          unsigned long long* inc_out, unsigned long long* cyc_out,
                                          uint32_t* info) {
  if (threadIdx.x != 0) return;
  const uint32_t b = blockIdx.x;
  unsigned long long* inc = inc_out + static_cast<size_t>(b) * max_changes;
  unsigned long long* cyc = cyc_out + static_cast<size_t>(b) * max_changes;
  uint64_t last = mb::globaltimer();
  const uint64_t start = last;
  uint32_t n = 0, reads = 1, reason = 0;
  for (;;) {
    if (n >= max_changes) { reason = 1; break; }
    if (reads >= max_reads) { reason = 2; break; }
    const uint64_t t = mb::globaltimer();
    ++reads;
    if (t != last) {
      const uint64_t c = mb::clock64();
      inc[n] = t - last;
      cyc[n] = c;
      ++n;
      last = t;
      if (t - start > max_ns) { reason = 3; break; }
    }
  }
  info[4 * b + 0] = n;
  info[4 * b + 1] = reads;
  info[4 * b + 2] = mb::smid();
  info[4 * b + 3] = reason;
}

// %clock64 against %globaltimer over interval_ns, lane 0 of each block. Both ends are taken right
// after a globaltimer change (read globaltimer, then clock64), so tick quantisation does not bias
// the interval. out[5*b + {0..4}] = {gt0, c0, gt1, c1, smid}.
extern "C" __global__ void clk_rate_probe(unsigned long long interval_ns, unsigned long long* out) {
  if (threadIdx.x != 0) return;
  // each loop below reads the timer at least once per iteration (>= 1 ns), so interval_ns
  // iterations bound it even if the timer stalls
  const unsigned long long max_iters = interval_ns + 100000ull;
  uint64_t g = mb::globaltimer();
  const uint64_t g_first = g;
  uint64_t g0 = g;
  for (unsigned long long i = 0; i < max_iters && g0 == g_first; ++i) g0 = mb::globaltimer();
  const uint64_t c0 = mb::clock64();
  uint64_t g1 = g0;
  for (unsigned long long i = 0; i < max_iters && g1 - g0 < interval_ns; ++i) g1 = mb::globaltimer();
  const uint64_t c1 = mb::clock64();
  unsigned long long* o = out + 5ull * blockIdx.x;
  o[0] = g0;
  o[1] = c0;
  o[2] = g1;
  o[3] = c1;
  o[4] = mb::smid();
}

// Issue cost of reading a timer: `iters` x CLK_READS_PER_ITER reads, unrolled, each folded into
// an accumulator, timed with %clock64 by thread 0 (one thread: no warp contention).
// mode 0: the same loop with an opaque value instead of a read (loop + accumulate overhead),
// 1: %globaltimer, 2: %clock64, 3: %globaltimer then %clock64 (the pair a stamp reads).
// out[2*blockIdx.x] = cycles, out[2*blockIdx.x + 1] = accumulator (keeps the reads alive).
extern "C" __global__ void clk_read_cost(uint32_t mode, uint32_t iters, unsigned long long* out) {
  if (threadIdx.x != 0) return;
  uint64_t acc = 0;
  uint64_t c0 = 0, c1 = 0;
  if (mode == 0) {
    c0 = mb::clock64();
    for (uint32_t i = 0; i < iters; ++i) {
#pragma unroll
      for (int u = 0; u < CLK_READS_PER_ITER; ++u) {
        uint64_t v = i + u;
        asm volatile("" : "+l"(v));  // opaque: the compiler cannot fold the sum
        acc += v;
      }
    }
    c1 = mb::clock64();
  } else if (mode == 1) {
    c0 = mb::clock64();
    for (uint32_t i = 0; i < iters; ++i) {
#pragma unroll
      for (int u = 0; u < CLK_READS_PER_ITER; ++u) acc += mb::globaltimer();
    }
    c1 = mb::clock64();
  } else if (mode == 2) {
    c0 = mb::clock64();
    for (uint32_t i = 0; i < iters; ++i) {
#pragma unroll
      for (int u = 0; u < CLK_READS_PER_ITER; ++u) acc += mb::clock64();
    }
    c1 = mb::clock64();
  } else {
    c0 = mb::clock64();
    for (uint32_t i = 0; i < iters; ++i) {
#pragma unroll
      for (int u = 0; u < CLK_READS_PER_ITER; ++u) {
        acc += mb::globaltimer();
        acc ^= mb::clock64();
      }
    }
    c1 = mb::clock64();
  }
  out[2 * blockIdx.x] = c1 - c0;
  out[2 * blockIdx.x + 1] = acc;
}

// Cost of one profiler stamp as the megakernel issues it: lane 0 of warp 0 stamps `n` times back
// to back (the layout must hold n records, else the rest take the cheaper overflow path).
// Compiled with MB_PROFILE=1 by the benchmark; with MB_PROFILE=0 it times an empty loop.
// out[0] = cycles for the n stamps.
extern "C" __global__ void clk_stamp_cost(uint32_t n, unsigned long long* out, MB_PROF_PARAMS) {
  mb::prof::Profiler prof(MB_PROF_ARGS);
  if (threadIdx.x != 0) return;
  const uint64_t c0 = mb::clock64();
#pragma unroll 8
  for (uint32_t i = 0; i < n; ++i) prof.stamp(CLK_TIMERS_EV_MARK, i);
  const uint64_t c1 = mb::clock64();
  out[0] = c1 - c0;
}
