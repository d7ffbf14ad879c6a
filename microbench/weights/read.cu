// Streaming reads: the read-bandwidth ceiling (DRAM), the L2 bandwidth-vs-working-set curve and
// the eviction-hint experiment all use this one loop.
//
// Each thread walks a *virtual* index j over [0, total) in grid-stride order, UNROLL independent
// 16-byte loads in flight before the first is consumed; the physical word is j mod n16, so
// total = reps * n16 reads a small working set `reps` times with full memory-level parallelism
// (total = n16 is a plain single pass). Every word read is summed (32-bit, per uint4 lane), so
// nothing can be skipped: block b writes its 4 lane sums to out[4b..4b+3] and the host checks
// their sum against torch on fresh random data (expected: reps * column sums, mod 2^32).
//
// Bounds: n16 < 2^31 (the physical index is 32-bit and j mod n16 is advanced by adding
// stride mod n16 with one conditional subtraction, which must not overflow). plan.py checks.
//
// Variants: LD 0 = ld.global.nc.L1::no_allocate, 1 = ld.global.cg (L2 only), 2 = ld.global.cg
// with an L2 eviction policy chosen by `policy_kind` (0 normal, 1 evict_first, 2 evict_last).
// mb_read_broken never reads the last word: the checker must catch it.
#include "mb/types.cuh"
#include "mb/ptx.cuh"

#ifndef READ_MAX_THREADS
#define READ_MAX_THREADS 1024
#endif

namespace {

__device__ __forceinline__ uint64_t make_policy(uint32_t kind) {
  return kind == 1u ? mb::policy_evict_first() : (kind == 2u ? mb::policy_evict_last() : mb::policy_evict_normal());
}

template <int LD>
__device__ __forceinline__ uint4 load16(const uint4* p, uint64_t policy) {
  if constexpr (LD == 0) return mb::ld_nc_v4(p);
  else if constexpr (LD == 1) return mb::ld_cg_v4(p);
  else return mb::ld_cg_v4_hint(p, policy);
}

__device__ __forceinline__ void add4(uint4& a, const uint4& v) {
  a.x += v.x; a.y += v.y; a.z += v.z; a.w += v.w;
}

__device__ __forceinline__ void warp_sum4(uint4& acc) {
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    acc.x += __shfl_xor_sync(0xFFFFFFFFu, acc.x, o);
    acc.y += __shfl_xor_sync(0xFFFFFFFFu, acc.y, o);
    acc.z += __shfl_xor_sync(0xFFFFFFFFu, acc.z, o);
    acc.w += __shfl_xor_sync(0xFFFFFFFFu, acc.w, o);
  }
}

// Block reduction of the 4 lane sums (every thread calls it); thread 0 writes out[4*blockIdx.x + c].
__device__ __forceinline__ void block_store4(uint4 acc, uint32_t* out) {
  __shared__ uint4 part[READ_MAX_THREADS / 32];
  warp_sum4(acc);
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  if (lane == 0) part[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    uint4 t = lane < nwarps ? part[lane] : make_uint4(0, 0, 0, 0);
    warp_sum4(t);
    if (lane == 0) {
      out[4 * blockIdx.x + 0] = t.x;
      out[4 * blockIdx.x + 1] = t.y;
      out[4 * blockIdx.x + 2] = t.z;
      out[4 * blockIdx.x + 3] = t.w;
    }
  }
}

template <int U, int LD, bool BROKEN>
__device__ __forceinline__ void read_body(const uint4* __restrict__ src, uint32_t n16, unsigned long long total,
                                          uint32_t* __restrict__ out, uint32_t policy_kind) {
  const uint64_t policy = LD == 2 ? make_policy(policy_kind) : 0ull;
  // grid x block < 2^32 (a persistent grid), so the start index and the stride are 32-bit and
  // the two modulos are 32-bit (a 64-bit one is a slow call with a stack frame).
  const uint32_t stride32 = gridDim.x * blockDim.x;
  const unsigned long long stride = stride32;
  const uint32_t step = stride32 % n16;  // j += stride  <=>  p += step (mod n16)
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long j = tid;
  uint32_t p = tid % n16;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (; j + (U - 1) * stride < total; j += U * stride) {
    uint32_t q[U];
    q[0] = p;
#pragma unroll
    for (int u = 1; u < U; ++u) {
      q[u] = q[u - 1] + step;
      q[u] = q[u] >= n16 ? q[u] - n16 : q[u];
    }
    p = q[U - 1] + step;
    p = p >= n16 ? p - n16 : p;
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load16<LD>(src + q[u], policy);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (BROKEN && q[u] == n16 - 1) continue;  // BUG on purpose
      add4(acc, v[u]);
    }
  }
  for (; j < total; j += stride) {
    const uint4 v = load16<LD>(src + p, policy);
    if (!(BROKEN && p == n16 - 1)) add4(acc, v);
    p += step;
    p = p >= n16 ? p - n16 : p;
  }
  block_store4(acc, out);
}

}  // namespace

#define MB_READ_KERNEL(NAME, U, LD)                                                                       \
  extern "C" __global__ void __launch_bounds__(READ_MAX_THREADS) NAME(                                  \
      const uint4* __restrict__ src, uint32_t n16, unsigned long long total, uint32_t* __restrict__ out, \
      uint32_t policy_kind) {                                                                           \
    MB_INJECT_SCOPE(); /* the gate's calibrated slowdown (mb/inject.cuh) */                             \
    read_body<U, LD, false>(src, n16, total, out, policy_kind);                                         \
  }

MB_READ_KERNEL(mb_read_nc_u2, 2, 0)
MB_READ_KERNEL(mb_read_nc_u4, 4, 0)
MB_READ_KERNEL(mb_read_nc_u8, 8, 0)
MB_READ_KERNEL(mb_read_cg_u4, 4, 1)
MB_READ_KERNEL(mb_read_cg_u8, 8, 1)
MB_READ_KERNEL(mb_read_hint_u4, 4, 2)

extern "C" __global__ void __launch_bounds__(READ_MAX_THREADS) mb_read_broken(
    const uint4* __restrict__ src, uint32_t n16, unsigned long long total, uint32_t* __restrict__ out,
    uint32_t policy_kind) {
  read_body<4, 0, true>(src, n16, total, out, policy_kind);
}

// Puts every 128-byte L2 line of [p, p + n128*128) back to evict_normal priority, so lines a
// benchmark marked evict_last do not keep shrinking the L2 for whatever runs next.
extern "C" __global__ void mb_l2_priority_normal(const unsigned char* p, unsigned long long n128) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n128;
       i += (unsigned long long)gridDim.x * blockDim.x)
    mb::applypriority_l2_normal(p + i * 128ull);
}
