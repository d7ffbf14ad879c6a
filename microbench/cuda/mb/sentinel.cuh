// Sentinel-valued slots: data and readiness in the same word, so publishing needs no flag and no
// fence on the data path. An empty slot holds the sentinel pattern; a writer canonicalises every
// element so it never writes that pattern; a reader polls each element until it differs.
//
// Rules (constants generated from microbench/sync/sentinel.py into mb/sentinel_rules.cuh):
//   fp32 (all-reduce slots): empty = -0.0 (0x80000000); a written -0.0 is stored as +0.0.
//   bf16 (gather slots):     empty = 0xFFFF (all-ones NaN); a written 0xFFFF is stored as 0x7FC0.
//   Every other bit pattern passes bit-exact (NaN payloads, infinities, subnormals included).
//
// Agent-agnostic: every pointer may be local or peer-GPU memory. The Scope template parameter
// says who the other side is (Scope::gpu: SMs of this GPU; Scope::sys: another GPU or the host).
// Prefer polling local memory and writing remote (the writer pushes into the reader's slots).
//
// API (all in mb::sentinel):
//   element rules, host and device:  f32_encode/f32_ready, bf16_encode/bf16_ready,
//                                    bf16x2_encode/bf16x2_ready (a 32-bit word of two bf16)
//   format policies:                 F32, BF16  (::FILL word, ::encode(word), ::ready(word))
//   16-byte vectors (device):        encode16<Fmt>, ready16<Fmt>, fill16<Fmt>,
//                                    put16<Fmt,S>(slot, raw)      encode + one strong store
//                                    reset16<Fmt,S>(slot)         store the empty pattern
//                                    wait16<Fmt,S>(wd, slot, out, what[, backoff])  bounded poll
//   block-cooperative ranges:        put<Fmt,S>, wait<Fmt,S>, reset<Fmt,S>  (thread tid of nthr
//                                    handles 16-byte vectors tid, tid+nthr, ...)
//   double buffering:                copy_offset(round, copies, copy_bytes)
//                                    reuse_fence<S>()  (see "slot reuse" below)
//
// Slot reuse (the part that is easy to get wrong). The reader resets a consumed copy to the
// sentinel so it can be reused; that reset must be ordered before the producer's next write into
// the same copy, or a late reset store erases fresh data and the reader waits forever (the
// watchdog then reports the slot). The sentinel path itself has no acquire/release, so:
//   * 2 copies: consume(r) -> reset(copy r%2) -> reuse_fence -> publish(r+1). The fence is both
//     the release of the resets and the acquire of the consumed data (which the producer relies on
//     before it writes r+2 into the same copy after seeing our r+1).
//   * 3 copies: consume(r) -> reuse_fence -> reset(copy r%3) -> publish(r+1). The fence now orders
//     the resets issued one round earlier, which have long drained, so it is cheap; the copy
//     reset at round r is reused only at r+3.
//   * a one-way stream (no reply path): after resetting, release a per-copy "free" counter
//     (st.release); the producer acquires it before reusing that copy.
// A fence executed by one thread covers the whole block's resets when it sits between two
// __syncthreads() (bar.sync orders them at CTA scope; the fence is cumulative).
#pragma once
#include "mb/types.cuh"
#include "mb/sentinel_rules.cuh"

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#include "mb/ptx.cuh"
#include "mb/spin.cuh"
#define MB_SENTINEL_HD __host__ __device__ __forceinline__
#else
#define MB_SENTINEL_HD inline
#endif

namespace mb {
namespace sentinel {

// ---------------------------------------------------------------- element rules (host + device)
MB_SENTINEL_HD constexpr uint32_t f32_encode(uint32_t bits) { return bits == F32_SENTINEL ? F32_REPLACEMENT : bits; }
MB_SENTINEL_HD constexpr bool f32_ready(uint32_t bits) { return bits != F32_SENTINEL; }
MB_SENTINEL_HD constexpr uint16_t bf16_encode(uint16_t h) { return h == BF16_SENTINEL ? BF16_REPLACEMENT : h; }
MB_SENTINEL_HD constexpr bool bf16_ready(uint16_t h) { return h != BF16_SENTINEL; }
// Two bf16 in one little-endian 32-bit word: element 2i in bits 0-15, element 2i+1 in bits 16-31.
MB_SENTINEL_HD constexpr uint32_t bf16x2_encode(uint32_t w) {
  return static_cast<uint32_t>(bf16_encode(static_cast<uint16_t>(w & 0xFFFFu))) |
         (static_cast<uint32_t>(bf16_encode(static_cast<uint16_t>(w >> 16))) << 16);
}
MB_SENTINEL_HD constexpr bool bf16x2_ready(uint32_t w) {
  return bf16_ready(static_cast<uint16_t>(w & 0xFFFFu)) && bf16_ready(static_cast<uint16_t>(w >> 16));
}

// Format policies: word-level encode/ready and the word an empty slot holds.
struct F32 {
  static constexpr uint32_t FILL = F32_FILL_WORD;
  MB_SENTINEL_HD static constexpr uint32_t encode(uint32_t w) { return f32_encode(w); }
  MB_SENTINEL_HD static constexpr bool ready(uint32_t w) { return f32_ready(w); }
};
struct BF16 {
  static constexpr uint32_t FILL = BF16_FILL_WORD;
  MB_SENTINEL_HD static constexpr uint32_t encode(uint32_t w) { return bf16x2_encode(w); }
  MB_SENTINEL_HD static constexpr bool ready(uint32_t w) { return bf16x2_ready(w); }
};

static_assert(!F32::ready(F32::FILL) && !BF16::ready(BF16::FILL), "an empty slot must not look ready");
static_assert(F32::ready(F32::encode(F32::FILL)) && BF16::ready(BF16::encode(BF16::FILL)),
              "encoding the sentinel must yield a ready value");

MB_SENTINEL_HD constexpr uint64_t copy_offset(uint64_t round, uint32_t copies, uint64_t copy_bytes) {
  return (round % copies) * copy_bytes;
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// ---------------------------------------------------------------- 16-byte vectors (device)
template <class Fmt> __device__ __forceinline__ uint4 encode16(uint4 v) {
  return make_uint4(Fmt::encode(v.x), Fmt::encode(v.y), Fmt::encode(v.z), Fmt::encode(v.w));
}
template <class Fmt> __device__ __forceinline__ bool ready16(uint4 v) {
  return Fmt::ready(v.x) && Fmt::ready(v.y) && Fmt::ready(v.z) && Fmt::ready(v.w);
}
template <class Fmt> __device__ __forceinline__ uint4 fill16() {
  return make_uint4(Fmt::FILL, Fmt::FILL, Fmt::FILL, Fmt::FILL);
}
// The first word of `v` that is not (entirely) ready, for diagnostics; FILL if none is found.
template <class Fmt> __device__ __forceinline__ uint32_t first_unready(uint4 v) {
  return !Fmt::ready(v.x) ? v.x : !Fmt::ready(v.y) ? v.y : !Fmt::ready(v.z) ? v.z : !Fmt::ready(v.w) ? v.w : Fmt::FILL;
}

// Encode and publish 16 bytes with one strong store (slot: 16-byte aligned, local or peer).
template <class Fmt, Scope S> __device__ __forceinline__ void put16(void* slot, uint4 raw) {
  st_relaxed_v4<S>(slot, encode16<Fmt>(raw));
}
// Mark 16 bytes empty again (see "slot reuse" above for the ordering this needs).
template <class Fmt, Scope S> __device__ __forceinline__ void reset16(void* slot) {
  st_relaxed_v4<S>(slot, fill16<Fmt>());
}
// Bounded wait until every element of the 16 bytes is ready; the data is in `out`. Each element
// is single-copy atomic, the vector is not, so the vector is re-read until all are ready (an
// element never reverts while its round is live). On timeout the watchdog records `what`, the
// slot address, the sentinel word expected to change, and the last unready word seen; returns false.
template <class Fmt, Scope S>
__device__ __forceinline__ bool wait16(const Watchdog& w, const void* slot, uint4& out, uint32_t what,
                                       uint32_t backoff_ns = 0) {
  return spin_until(
      w, what, slot, Fmt::FILL,
      [&](uint64_t& seen) {
        out = ld_relaxed_v4<S>(slot);
        if (ready16<Fmt>(out)) return true;
        seen = first_unready<Fmt>(out);
        return false;
      },
      backoff_ns);
}

// ---------------------------------------------------------------- block-cooperative ranges
template <class Fmt, Scope S>
__device__ __forceinline__ void put(void* slot, const uint4* raw, uint32_t n16, uint32_t tid, uint32_t nthr) {
  uint4* d = static_cast<uint4*>(slot);
  for (uint32_t i = tid; i < n16; i += nthr) put16<Fmt, S>(d + i, raw[i]);
}
// Four vectors per thread in flight: a batch's loads are issued together and only vectors still
// empty are re-polled (polling one vector at a time costs an L2 round trip per 16 bytes).
template <class Fmt, Scope S>
__device__ __forceinline__ bool wait(const Watchdog& w, const void* slot, uint4* out, uint32_t n16, uint32_t tid,
                                     uint32_t nthr, uint32_t what, uint32_t backoff_ns = 0) {
  const uint4* s = static_cast<const uint4*>(slot);
  for (uint32_t i = tid; i < n16; i += 4 * nthr) {
    uint4 v[4];
#pragma unroll
    for (uint32_t u = 0; u < 4; ++u)
      if (i + u * nthr < n16) v[u] = ld_relaxed_v4<S>(s + i + u * nthr);
#pragma unroll
    for (uint32_t u = 0; u < 4; ++u) {
      const uint32_t j = i + u * nthr;
      if (j >= n16) break;
      if (!ready16<Fmt>(v[u]) && !wait16<Fmt, S>(w, s + j, v[u], what, backoff_ns)) return false;
      out[j] = v[u];
    }
  }
  return true;
}
template <class Fmt, Scope S>
__device__ __forceinline__ void reset(void* slot, uint32_t n16, uint32_t tid, uint32_t nthr) {
  uint4* d = static_cast<uint4*>(slot);
  for (uint32_t i = tid; i < n16; i += nthr) reset16<Fmt, S>(d + i);
}
// The one fence slot reuse needs per round (2 copies: after the resets; 3 copies: before them).
template <Scope S> __device__ __forceinline__ void reuse_fence() { fence_acq_rel<S>(); }
#endif

}  // namespace sentinel
}  // namespace mb
