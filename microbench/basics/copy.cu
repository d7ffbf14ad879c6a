// Device-to-device copy, the foundation's first real kernel: 16-byte vector loads/stores,
// UNROLL independent loads in flight per thread before the first store, grid-stride over a
// persistent-sized grid. Bound: bytes read + written over the copy engine's measured rate.
//
// mb_copy_broken drops the last 16-byte word of every thread's stride pass: the correctness
// check must catch it (tests prove the checker can fail).
#include "mb/types.cuh"

#ifndef UNROLL
#define UNROLL 4
#endif

extern "C" __global__ void __launch_bounds__(512) mb_copy_v4(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                             unsigned long long n16) {
  MB_INJECT_SCOPE();  // the gate's calibrated slowdown (mb/inject.cuh): nothing unless MB_INJECT_PPM
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n16; i += stride) dst[i] = src[i];
}

extern "C" __global__ void __launch_bounds__(512) mb_copy_broken(const uint4* __restrict__ src,
                                                                 uint4* __restrict__ dst, unsigned long long n16) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i + 1 < n16; i += stride)
    dst[i] = src[i];  // BUG on purpose: the final word is never written
}
