// Bounded spin-waits. A persistent kernel has no interrupts: a warp that waits for data polls.
// Every poll here gives up after `bound_ns` of %globaltimer time, records what it waited for in
// a watchdog record (first tripper wins), and returns false; every other waiter sees the trip on
// its next check and gives up too, so a broken dependency ends the kernel instead of hanging
// the GPU. The host reads the record (microbench/watchdog.py) and raises SpinTimeoutError.
//
// The record layout is the WD_* enum in mb/watchdog.cuh (parsed by watchdog.py: the only copy).
#pragma once
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/watchdog.cuh"

namespace mb {

__device__ __forceinline__ bool wd_tripped(const Watchdog& w) {
  return *reinterpret_cast<volatile unsigned long long*>(&w.rec[WD_TRIPPED]) != 0ull;
}

__device__ __noinline__ void wd_report(const Watchdog& w, uint32_t what, const void* addr, uint64_t expected,
                                       uint64_t seen, uint64_t elapsed) {
  if (atomicCAS(&w.rec[WD_TRIPPED], 0ull, 1ull) == 0ull) {
    w.rec[WD_BLOCK] = blockIdx.x;
    w.rec[WD_THREAD] = threadIdx.x;
    w.rec[WD_WHAT] = what;
    w.rec[WD_ADDR] = reinterpret_cast<unsigned long long>(addr);
    w.rec[WD_EXPECTED] = expected;
    w.rec[WD_SEEN] = seen;
    w.rec[WD_ELAPSED_NS] = elapsed;
    __threadfence();
  }
}

// Wait until (int32)(*flag - target) >= 0 (a monotonically increasing counter reached target).
// Acquire semantics: reads after a true return see what the producer released.
__device__ __forceinline__ bool spin_geq(const Watchdog& w, const uint32_t* flag, uint32_t target, uint32_t what,
                                         uint32_t backoff_ns = 0) {
  uint32_t v = ld_acquire_gpu(flag);
  if (static_cast<int32_t>(v - target) >= 0) return true;
  const uint64_t t0 = globaltimer();
  for (uint32_t i = 1;; ++i) {
    if (backoff_ns) nanosleep(backoff_ns);
    v = ld_acquire_gpu(flag);
    if (static_cast<int32_t>(v - target) >= 0) return true;
    if ((i & 63u) == 0u) {
      const uint64_t dt = globaltimer() - t0;
      if (dt > w.bound_ns) { wd_report(w, what, flag, target, v, dt); return false; }
      if (wd_tripped(w)) return false;
    }
  }
}

// Same, system scope (flags written by the host or by a peer GPU over NVLink/PCIe).
__device__ __forceinline__ bool spin_geq_sys(const Watchdog& w, const uint32_t* flag, uint32_t target, uint32_t what,
                                             uint32_t backoff_ns = 0) {
  uint32_t v = ld_acquire_sys(flag);
  if (static_cast<int32_t>(v - target) >= 0) return true;
  const uint64_t t0 = globaltimer();
  for (uint32_t i = 1;; ++i) {
    if (backoff_ns) nanosleep(backoff_ns);
    v = ld_acquire_sys(flag);
    if (static_cast<int32_t>(v - target) >= 0) return true;
    if ((i & 63u) == 0u) {
      const uint64_t dt = globaltimer() - t0;
      if (dt > w.bound_ns) { wd_report(w, what, flag, target, v, dt); return false; }
      if (wd_tripped(w)) return false;
    }
  }
}

// Generic bounded wait: `probe(seen)` returns true when ready and writes what it saw.
template <typename Probe>
__device__ __forceinline__ bool spin_until(const Watchdog& w, uint32_t what, const void* addr, uint64_t expected,
                                           Probe probe, uint32_t backoff_ns = 0) {
  uint64_t seen = 0;
  if (probe(seen)) return true;
  const uint64_t t0 = globaltimer();
  for (uint32_t i = 1;; ++i) {
    if (backoff_ns) nanosleep(backoff_ns);
    if (probe(seen)) return true;
    if ((i & 63u) == 0u) {
      const uint64_t dt = globaltimer() - t0;
      if (dt > w.bound_ns) { wd_report(w, what, addr, expected, seen, dt); return false; }
      if (wd_tripped(w)) return false;
    }
  }
}

// Bounded wait on an mbarrier phase (bulk copies that never land must not hang the SM).
__device__ __forceinline__ bool mbar_wait(const Watchdog& w, uint64_t* bar, uint32_t parity, uint32_t what) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t t0 = globaltimer();
  for (uint32_t i = 1;; ++i) {
    if (mbar_try_wait(bar, parity)) return true;
    if ((i & 63u) == 0u) {
      const uint64_t dt = globaltimer() - t0;
      if (dt > w.bound_ns) { wd_report(w, what, bar, parity, 0xFFFFFFFFull, dt); return false; }
      if (wd_tripped(w)) return false;
    }
  }
}

}  // namespace mb
