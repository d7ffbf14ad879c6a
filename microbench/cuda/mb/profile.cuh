// In-kernel profiler. Lane 0 of a warp writes a 32-byte record (event, argument, %globaltimer,
// optional %clock64, SM, block) into a global buffer; microbench/clocks/profiler.py turns the
// buffer into a typed timeline, a pandas view, a Perfetto trace and a plot.
//
// MB_PROFILE=0 (the default) compiles it out entirely: Profiler becomes an empty struct with
// empty inline methods, so a kernel full of stamps is the same machine code as the kernel
// without them (tests/test_clocks_profile_compile.py compares the code bytes). Argument
// expressions of stamp() are still evaluated as C++: pass side-effect-free values.
//
// Usage (event ids come from a Python ProfileEvents registry rendered into a header, never
// literals):
//   #include "mb/profile.cuh"
//   #include "gen/my_events.cuh"
//   extern "C" __global__ void k(float* x, MB_PROF_PARAMS) {   // keep MB_PROF_PARAMS last
//     mb::prof::Profiler prof(MB_PROF_ARGS);
//     prof.stamp(MY_EV_LOAD_BEGIN, layer);  ...  prof.stamp(MY_EV_LOAD_END, layer);
//   }
// The host passes ProfileBuffer.args(launch) for the two parameters, or (0, 0) to record nothing.
// The parameters exist in both builds, so the host code does not change with MB_PROFILE.
//
// Who records: lane 0 of warps 0..W-1 of blocks 0..B-1 (W, B from the layout). stamp() may be
// called by the whole warp or by lane 0 alone; a call that lane 0 does not make records nothing.
// Cost when enabled: per stamp one %globaltimer read (+ one %clock64 read with MB_PROF_CLOCK64=1),
// two 16-byte streaming stores, a compare and an add; per recording warp and launch one store (two
// for block 0's warp 0) when the Profiler is built. The timer reads carry a "memory" clobber, so
// the compiler keeps the stamp in program order with the surrounding loads and stores; the
// stamp marks when the warp *issued* past that point, not when earlier loads completed.
//
// Record: tag (VALID | warp << 16 | event), arg, globaltimer lo/hi, clock64 lo/hi (0 without
// MB_PROF_CLOCK64), smid, epoch << 18 | low 18 bits of the block index.
//
// Buffer layout for one launch (every offset follows from the 64-bit `meta` parameter, so the
// device loads nothing to find its slot):
//   [0, HEADER_BYTES)                 header written by the host (the device never reads it),
//                                     except word H_EPOCH, which the recording launch writes
//   [HEADER_BYTES, +align32(4*B*W))   overflow counters, u32 per (block, warp slot)
//   then B*W*C records of RECORD_WORDS u32; (block b, warp w) owns records [(b*W+w)*C, +C)
// meta = B | W << META_WARPS_SHIFT | C << META_CAP_SHIFT | epoch << META_EPOCH_SHIFT.
// A record's last word is the epoch, so records left over from an earlier use of the buffer
// are recognised (the host bumps the epoch on every reset instead of clearing the records).
// The reset itself happens here, on the device: each recording lane zeroes its overflow counter
// and block 0's warp 0 stamps the epoch into the slice's header, so ProfileBuffer.reset() enqueues
// nothing: the host's reset was three small kernels per use (per megakernel step: three CUDA-graph
// nodes ahead of its persistent launches). A slice no launch of the epoch recorded keeps its older
// header epoch, and the reader treats it as not recorded.
// Never out of bounds: blocks >= B, warps >= W and lanes != 0 touch nothing; a stamp past C
// only stores the running overflow count into its counter.
//
// The enum below is parsed by microbench/clocks/profiler.py: it is the only copy of the layout.
#pragma once
#include "mb/types.cuh"
#include "mb/ptx.cuh"

#ifndef MB_PROFILE
#define MB_PROFILE 0
#endif
#ifndef MB_PROF_CLOCK64
#define MB_PROF_CLOCK64 0
#endif

// Kernel parameters of the profiler (declare last) and the matching constructor arguments.
#define MB_PROF_PARAMS unsigned long long *mb_prof_buf, unsigned long long mb_prof_meta
#define MB_PROF_ARGS mb_prof_buf, mb_prof_meta

namespace mb {
namespace prof {

enum ProfLayout : uint32_t {
  PROF_MAGIC = 0x4650424Du,       // "MBPF" little-endian, header word 0
  PROF_VERSION = 1u,              // header word 1
  PROF_HEADER_BYTES = 64u,
  PROF_RECORD_WORDS = 8u,         // 32-byte records
  PROF_VALID = 0x80000000u,       // set in every written record's tag word
  PROF_TAG_WARP_SHIFT = 16u,      // tag = VALID | warp << 16 | event
  PROF_EVENT_MASK = 0xFFFFu,      // event ids are 16 bits (ProfileEvents refuses more)
  PROF_META_BLOCKS_MASK = 0xFFFFFFu,
  PROF_META_WARPS_SHIFT = 24u,
  PROF_META_WARPS_MASK = 0x3Fu,
  PROF_META_CAP_SHIFT = 30u,
  PROF_META_CAP_MASK = 0xFFFFFu,
  PROF_META_EPOCH_SHIFT = 50u,
  PROF_META_EPOCH_MASK = 0x3FFFu,
  // record word indices
  PROF_W_TAG = 0u,
  PROF_W_ARG = 1u,
  PROF_W_GT_LO = 2u,
  PROF_W_GT_HI = 3u,
  PROF_W_CLK_LO = 4u,
  PROF_W_CLK_HI = 5u,
  PROF_W_SM = 6u,
  PROF_W_EPOCH_BLOCK = 7u,   // epoch << EPOCH_BLOCK_SHIFT | (block & BLOCK_LOW_MASK): staleness + a check
  PROF_EPOCH_BLOCK_SHIFT = 18u,
  PROF_BLOCK_LOW_MASK = 0x3FFFFu,
  PROF_H_EPOCH = 7u          // header word of the epoch (the only one the device writes)
};

#if MB_PROFILE

class Profiler {
 public:
  __device__ __forceinline__ Profiler(unsigned long long* buf, unsigned long long meta) {
    const uint32_t nb = static_cast<uint32_t>(meta) & PROF_META_BLOCKS_MASK;
    const uint32_t nw = static_cast<uint32_t>(meta >> PROF_META_WARPS_SHIFT) & PROF_META_WARPS_MASK;
    const uint32_t cap = static_cast<uint32_t>(meta >> PROF_META_CAP_SHIFT) & PROF_META_CAP_MASK;
    const uint32_t tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const uint32_t blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const uint32_t warp = tid >> 5;
    n_ = 0u;
    cap_ = 0u;
    ovf_ = nullptr;
    rec_ = nullptr;
    tag_ = 0u;
    sm_ = 0u;
    eb_ = 0u;
    if (buf != nullptr && (tid & 31u) == 0u && blk < nb && warp < nw && cap > 0u) {
      char* base = reinterpret_cast<char*>(buf);
      const unsigned long long slot = static_cast<unsigned long long>(blk) * nw + warp;
      const unsigned long long ovf_bytes = (static_cast<unsigned long long>(nb) * nw * 4ull + 31ull) & ~31ull;
      ovf_ = reinterpret_cast<uint32_t*>(base + PROF_HEADER_BYTES) + slot;
      rec_ = reinterpret_cast<uint32_t*>(base + PROF_HEADER_BYTES + ovf_bytes) + slot * cap * PROF_RECORD_WORDS;
      cap_ = cap;
      tag_ = PROF_VALID | (warp << PROF_TAG_WARP_SHIFT);
      sm_ = smid();  // blocks do not migrate between SMs, so once is enough
      const uint32_t epoch = static_cast<uint32_t>(meta >> PROF_META_EPOCH_SHIFT) & PROF_META_EPOCH_MASK;
      eb_ = (epoch << PROF_EPOCH_BLOCK_SHIFT) | (blk & PROF_BLOCK_LOW_MASK);
      *ovf_ = 0u;  // the reset (see the layout above); a later overflow overwrites it in order
      if (slot == 0ull) reinterpret_cast<uint32_t*>(base)[PROF_H_EPOCH] = epoch;
    }
  }

  // Record `event` (an id from the generated header) with a free 32-bit argument.
  __device__ __forceinline__ void stamp(uint32_t event, uint32_t arg = 0u) {
    if (n_ < cap_) {
      const uint64_t t = globaltimer();
#if MB_PROF_CLOCK64
      const uint64_t c = clock64();
#else
      const uint64_t c = 0ull;
#endif
      uint32_t* r = rec_ + n_ * PROF_RECORD_WORDS;
      st_cs_v4(r, tag_ | (event & PROF_EVENT_MASK), arg, static_cast<uint32_t>(t), static_cast<uint32_t>(t >> 32));
      st_cs_v4(r + 4, static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), sm_, eb_);
    } else if (ovf_ != nullptr) {
      *ovf_ = n_ + 1u - cap_;  // running count of stamps that found this warp's records full
    }
    ++n_;
  }

  // Deferred stamps: a kernel that saved the instants itself (a %globaltimer read and a
  // shared-memory store where they happen, no record written on its critical path) reserves k
  // consecutive records (the thread that built the profiler), then any thread of the block writes
  // record `idx` of them with put_at. The overflow count covers reserved records past the capacity.
  __device__ __forceinline__ uint32_t reserve(uint32_t k) {
    const uint32_t n = n_;
    n_ = n + k;
    if (n_ > cap_ && ovf_ != nullptr) *ovf_ = n_ - cap_;
    return n;
  }
  __device__ __forceinline__ void put_at(uint32_t idx, uint64_t t, uint32_t event, uint32_t arg,
                                         uint64_t c64 = 0ull) const {
    if (idx < cap_) {
      uint32_t* r = rec_ + idx * PROF_RECORD_WORDS;
      st_cs_v4(r, tag_ | (event & PROF_EVENT_MASK), arg, static_cast<uint32_t>(t), static_cast<uint32_t>(t >> 32));
      st_cs_v4(r + 4, static_cast<uint32_t>(c64), static_cast<uint32_t>(c64 >> 32), sm_, eb_);
    }
  }

 private:
  uint32_t* rec_;
  uint32_t* ovf_;
  uint32_t n_, cap_, tag_, sm_, eb_;
};

#else  // MB_PROFILE == 0: nothing at all

class Profiler {
 public:
  __device__ __forceinline__ Profiler(unsigned long long*, unsigned long long) {}
  __device__ __forceinline__ void stamp(uint32_t, uint32_t = 0u) {}
  __device__ __forceinline__ uint32_t reserve(uint32_t) { return 0u; }
  __device__ __forceinline__ void put_at(uint32_t, uint64_t, uint32_t, uint32_t, uint64_t = 0ull) const {}
};

#endif

// RAII phase: stamps `begin` now and `end` when the scope closes (both with `arg`).
class Span {
 public:
  __device__ __forceinline__ Span(Profiler& p, uint32_t begin, uint32_t end, uint32_t arg = 0u)
      : p_(p), end_(end), arg_(arg) {
    p_.stamp(begin, arg);
  }
  __device__ __forceinline__ ~Span() { p_.stamp(end_, arg_); }

 private:
  Profiler& p_;
  uint32_t end_, arg_;
};

}  // namespace prof
}  // namespace mb
