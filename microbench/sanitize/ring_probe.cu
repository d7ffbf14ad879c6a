// The bulk-copy ring protocol in its smallest form, for compute-sanitizer racecheck: warp 1 lane 0
// produces, warp 0 (32 threads) consumes one 1 KB buffer, R rounds.
//   round r: producer waits `empty` phase r-1 (r > 0), fences the async proxy, announces 1 KB on
//   `full` and bulk-copies src[r] into the buffer; consumers wait `full` phase r, read, and each
//   arrives on `empty` (count 32).
// R = 1 has only the read-after-copy edge (completion through complete_tx); R = 3 adds the
// copy-after-read edge (the ring's reuse). CTA: the .shared::cta destination form (PTX 8.6) in
// place of .shared::cluster with a CTA address. OTHER: lane 0 of warp 1 waits, lane 1 issues the
// copy after __syncwarp (ordered through another lane's wait, as the megakernel's loader did).
// Every wait is bounded; out[t] = the reads' sum.
#include "mb/types.cuh"
#include "mb/ptx.cuh"

namespace {
constexpr int WORDS = 256;

template <bool CTA>
__device__ __forceinline__ void copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  if (CTA) {
    mb::bulk_g2s_cta(dst, src, bytes, bar);
  } else {
    mb::bulk_g2s(dst, src, bytes, bar);
  }
}

// false when the phase did not complete within ~2^24 probes (the caller records it in out)
__device__ __forceinline__ bool wait(uint64_t* bar, uint32_t parity) {
  for (uint32_t k = 0; k < (1u << 24); ++k)
    if (mb::mbar_try_wait(bar, parity)) return true;
  return false;
}

template <bool CTA, int R, bool OTHER = false>
__device__ void ring(const float* src, float* out) {
  __shared__ alignas(128) float buf[WORDS];
  __shared__ uint64_t full, empty;
  const int t = threadIdx.x;
  if (t == 0) {
    mb::mbar_init(&full, 1);
    mb::mbar_init(&empty, 32);
    mb::fence_mbar_init();
  }
  __syncthreads();
  float acc = 0.f;
  bool ok = true;
  for (int r = 0; r < R; ++r) {
    if (t >= 32) {
      if (t == 32) {
        if (r > 0) ok = ok && wait(&empty, (r - 1) & 1);
        mb::mbar_arrive_expect_tx(&full, WORDS * 4);
      }
      __syncwarp();
      if (t == (OTHER ? 33 : 32)) {
        mb::fence_proxy_async_smem();
        copy<CTA>(buf, src + WORDS * r, WORDS * 4, &full);
      }
    } else {
      ok = ok && wait(&full, r & 1);
      acc += buf[t] + buf[(t * 7 + 3) % WORDS];
      mb::mbar_arrive(&empty);
    }
  }
  if (t < 32) out[t] = ok ? acc : __int_as_float(0x7fc00000);
}
}  // namespace

extern "C" __global__ void probe_cluster_raw(const float* s, float* o) { ring<false, 1>(s, o); }
extern "C" __global__ void probe_cluster_ring(const float* s, float* o) { ring<false, 3>(s, o); }
extern "C" __global__ void probe_cta_raw(const float* s, float* o) { ring<true, 1>(s, o); }
extern "C" __global__ void probe_cta_ring(const float* s, float* o) { ring<true, 3>(s, o); }
extern "C" __global__ void probe_cta_ring_otherlane(const float* s, float* o) { ring<true, 3, true>(s, o); }
