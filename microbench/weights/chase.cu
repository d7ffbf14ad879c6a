// L2/DRAM load latency by pointer chase: ONE thread follows a random cyclic permutation of
// 128-byte-strided elements (one L2 line each), where each element's first 8 bytes hold the
// address of the next. Loads are ld.global.cg (L1 bypassed), so every step is an L2 access;
// whether it hits depends on the working set. Each load's address is the previous load's
// value, so the loads are fully serialised: time / steps is the load-to-use latency.
//
// Timers: %clock64 (cycles on this SM) and %globaltimer (ns) around the same `steps` loads;
// their ratio is the SM clock measured during the chase. The first `n_lat` loads are timed one
// by one (clock64 before the load, then after a shared-memory store that depends on the loaded
// value, so the store cannot issue before the load returns): their distribution shows near/far
// L2 partitions; each of those samples includes the store+clock overhead (tens of cycles).
//
// out[0] = final pointer (the host checks it against the permutation: a chase that skipped or
// repeated loads ends elsewhere), out[1] = cycles, out[2] = ns, out[3] = %smid.
#include "mb/types.cuh"
#include "mb/ptx.cuh"

#ifndef CHASE_UNROLL
#define CHASE_UNROLL 8
#endif

extern "C" __global__ void mb_chase(unsigned long long start, unsigned long long steps,
                                    unsigned long long* __restrict__ out, uint32_t* __restrict__ lat,
                                    uint32_t n_lat) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  __shared__ unsigned long long sink;
  uint64_t p = start;
  for (uint32_t i = 0; i < n_lat; ++i) {
    const uint64_t t0 = mb::clock64();
    p = mb::ld_cg_u64(reinterpret_cast<const void*>(p));
    asm volatile("st.volatile.shared.u64 [%0], %1;" :: "r"(mb::smem_addr(&sink)), "l"(p) : "memory");
    const uint64_t t1 = mb::clock64();
    lat[i] = (uint32_t)(t1 - t0);
  }
  const uint64_t c0 = mb::clock64();
  const uint64_t g0 = mb::globaltimer();
  unsigned long long i = 0;
  for (; i + CHASE_UNROLL <= steps; i += CHASE_UNROLL) {
#pragma unroll
    for (int u = 0; u < CHASE_UNROLL; ++u) p = mb::ld_cg_u64(reinterpret_cast<const void*>(p));
  }
  for (; i < steps; ++i) p = mb::ld_cg_u64(reinterpret_cast<const void*>(p));
  // the clocks are read after a store that needs the last loaded value
  asm volatile("st.volatile.shared.u64 [%0], %1;" :: "r"(mb::smem_addr(&sink)), "l"(p) : "memory");
  const uint64_t c1 = mb::clock64();
  const uint64_t g1 = mb::globaltimer();
  out[0] = p;
  out[1] = c1 - c0;
  out[2] = g1 - g0;
  out[3] = mb::smid();
}
