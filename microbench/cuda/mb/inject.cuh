// A calibrated slowdown, compiled in only for measuring the regression gate (`megabench gate
// --quality-run`, microbench/gate_quality.py): with MB_INJECT_PPM = p (parts per million; the
// compiler adds it from $MEGABENCH_INJECT_PPM) the last block of each launch to finish spins on
// %globaltimer for p/1e6 of its own running time, so every launch of a kernel that declares
// MB_INJECT_SCOPE() takes ~p ppm longer: a 5% regression of the case, whatever its size and
// launch count (a megakernel step in chain mode is ~135 launches, each slowed by its own 5%).
//
// Without the define (every normal build) MB_INJECT_SCOPE() is an empty statement: no
// instruction, no register, no global (tests/test_gate_inject.py compares the cubins' code).
//
// With it: one globaltimer read at the start of the kernel by thread (0,0,0) of each block, kept
// in a register; at the end of the block, that thread counts the block as done (one atomic on a
// module global) and the block that completes the count spins, then re-arms the count for the
// next launch. Danger: kernels launched so that two launches' blocks finish interleaved (PDL
// without a grid-dependency wait before the end) share the count and the spin can fall on the
// wrong launch; the megakernel's compute warps wait for the previous grid before they finish, so
// its count is one launch's. The spin is bounded by its own arithmetic (no wait on other blocks).
#pragma once

#ifndef MB_INJECT_PPM
#define MB_INJECT_PPM 0
#endif

#if MB_INJECT_PPM > 0 && defined(__CUDA_ARCH__)
namespace mb {
namespace inject {
__device__ unsigned int blocks_done;  // zero at module load; re-armed by each launch's last block

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}

struct Scope {
  unsigned long long t0;
  __device__ __forceinline__ Scope() : t0((threadIdx.x | threadIdx.y | threadIdx.z) ? 0ull : now_ns()) {}
  __device__ __forceinline__ ~Scope() {
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    const unsigned int blocks = gridDim.x * gridDim.y * gridDim.z;
    __threadfence();
    if (atomicAdd(&blocks_done, 1u) != blocks - 1u) return;
    const unsigned long long t1 = now_ns();
    const unsigned long long until = t1 + (t1 - t0) * (unsigned long long)(MB_INJECT_PPM) / 1000000ull;
    while (now_ns() < until) {
    }
    atomicExch(&blocks_done, 0u);
  }
};
}  // namespace inject
}  // namespace mb
#define MB_INJECT_SCOPE() ::mb::inject::Scope mb_inject_scope_
#else
#define MB_INJECT_SCOPE() \
  do {                    \
  } while (0)
#endif
