// The weight ring (mb/ring.cuh) as a benchmark, and the two-phase kernel behind the L2-prefetch
// and hot-expert experiments. One block per SM: warp 0 lane 0 is the producer, warps 1.. consume.
//
// mb_ring_stream: block b streams chunks c = b, b+G, b+2G, ... (chunk = one stage, stage_bytes)
//   of `src` through a ring of `stages` slots. Consumers sum every 32-bit word of every slot;
//   out[b] = that block's sum (mod 2^32), checked against torch on fresh random data.
//   mb_ring_stream_skip: consumers skip the last 16 bytes of every slot (the checker must fail).
//   mb_ring_stream_short: the producer announces 16 bytes more than it copies, so no slot ever
//   completes (the bounded waits must end in a watchdog record, not a hang).
//   mb_ring_stream_pieces: the same stream, but each stage arrives as `pieces` bulk copies of
//   stage_bytes / pieces issued by lanes 0..pieces-1 of the producer warp, each of which waits on
//   the slot's `empty` itself: how the megakernel fills a stage (one copy per padded weight row).
//
// mb_ring_phases: phase A, then phase B, separated by __syncthreads():
//   A: the producer lane first issues cp.async.bulk.prefetch.L2 for this block's share of the
//      `pf_list` items (fire-and-forget), then streams this block's share of `pa_src` (chunks
//      of stage_bytes, c = b, b+G, ...) through the ring; consumers sum those chunks and then
//      spin on %clock64 until `busy_cycles` have passed since the kernel started (the compute
//      the prefetch hides behind). pa_chunks = 0: pure busy phase; busy_cycles = 0: phase A is
//      bandwidth-bound and a prefetch competes with it.
//   B: the same ring (positions carried over from A) streams this block's share of the
//      `rd_list` items; consumers sum them.
//   Items: expert e (index from a list) is split into ceil(expert_bytes / stage_bytes) chunks;
//   item q = i * chunks + k is chunk k of list[i]; block b takes q = b, b+G, ...
//   out[2b] = phase-B sum, out[2b+1] = phase-A sum; stamps[3b..3b+2] = %globaltimer at kernel
//   start, end of A, end of B (thread 0).
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"
#include "mb/ring.cuh"

#ifndef RING_MAX_THREADS
#define RING_MAX_THREADS 1024
#endif

namespace {

enum Mode : int { MODE_OK = 0, MODE_SKIP = 1, MODE_SHORT = 2 };

__device__ __forceinline__ uint32_t sum4(const uint4& v) { return v.x + v.y + v.z + v.w; }

__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Sum over all threads of the block; thread 0 gets the total. Ends with a __syncthreads, so
// every thread must call it (convergently).
__device__ __forceinline__ uint32_t block_sum(uint32_t v, uint32_t* scratch /* 32 words */) {
  v = warp_sum(v);
  if ((threadIdx.x & 31u) == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  uint32_t t = 0;
  if (threadIdx.x == 0)
    for (uint32_t i = 0; i < blockDim.x / 32; ++i) t += scratch[i];
  __syncthreads();
  return t;
}

// Consumer side of one slot: this thread's share of the slot's 16-byte words.
template <int MODE>
__device__ __forceinline__ uint32_t consume_slot(const unsigned char* slot, uint32_t bytes, uint32_t ct,
                                                 uint32_t nct) {
  const uint4* s = reinterpret_cast<const uint4*>(slot);
  const uint32_t words = bytes / 16;
  uint32_t acc = 0;
#pragma unroll 4
  for (uint32_t i = ct; i < words; i += nct) {
    if (MODE == MODE_SKIP && i == words - 1) continue;  // BUG on purpose
    acc += sum4(s[i]);
  }
  return acc;
}

// Consumer warps of the stream kernels: this block's chunks (c = b, b+G, ...) in ring order; the
// sum of this thread's share of every slot.
template <int MODE>
__device__ __forceinline__ uint32_t consume_stream(const mb::Ring& r, const mb::Watchdog& w, unsigned long long nchunks,
                                                   uint32_t stages, uint32_t stage_bytes) {
  const uint32_t ct = threadIdx.x - 32, nct = blockDim.x - 32;
  uint32_t acc = 0;
  mb::RingPos p;
  for (unsigned long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
    if (!r.wait(w, p)) break;
    acc += consume_slot<MODE>(r.slot(p.stage), stage_bytes, ct, nct);
    r.release_warp(p);
    p.advance(stages);
  }
  return acc;
}

template <int MODE>
__device__ __forceinline__ void ring_stream(const unsigned char* __restrict__ src, unsigned long long nchunks,
                                            uint32_t stages, uint32_t stage_bytes, uint32_t* __restrict__ out,
                                            unsigned long long* wd_rec, unsigned long long bound_ns) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint32_t scratch[32];
  const mb::Watchdog w{wd_rec, bound_ns};
  const uint32_t warp = threadIdx.x / 32;
  const mb::Ring r = mb::Ring::carve(smem, stages, stage_bytes);
  if (threadIdx.x == 0) r.init(blockDim.x / 32 - 1);
  __syncthreads();
  uint32_t acc = 0;
  if (warp == 0) {
    if (mb::lane_id() == 0) {
      mb::RingPos p;
      for (unsigned long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
        if (!r.acquire(w, p)) break;
        if (MODE == MODE_SHORT) {  // BUG on purpose: 16 bytes announced that never arrive
          mb::mbar_arrive_expect_tx(&r.full[p.stage], stage_bytes + 16);
          mb::bulk_g2s(r.slot(p.stage), src + c * stage_bytes, stage_bytes, &r.full[p.stage]);
        } else {
          r.issue(p, src + c * stage_bytes, stage_bytes);
        }
        p.advance(stages);
      }
    }
    __syncwarp();
  } else {
    acc = consume_stream<MODE>(r, w, nchunks, stages, stage_bytes);
  }
  const uint32_t t = block_sum(acc, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = t;
}

// Producer warp of mb_ring_stream_pieces: every lane acquires (a lane that copies into the slot
// must itself have observed the consumers' release), lane 0 announces the stage's bytes, lanes
// < pieces each copy one piece. Consumers as in ring_stream (consume_stream).
__device__ __forceinline__ void ring_stream_pieces(const unsigned char* __restrict__ src, unsigned long long nchunks,
                                                   uint32_t stages, uint32_t stage_bytes, uint32_t pieces,
                                                   uint32_t* __restrict__ out, unsigned long long* wd_rec,
                                                   unsigned long long bound_ns) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint32_t scratch[32];
  const mb::Watchdog w{wd_rec, bound_ns};
  const uint32_t warp = threadIdx.x / 32, lane = mb::lane_id(), piece = stage_bytes / pieces;
  const mb::Ring r = mb::Ring::carve(smem, stages, stage_bytes);
  if (threadIdx.x == 0) r.init(blockDim.x / 32 - 1);
  __syncthreads();
  uint32_t acc = 0;
  if (warp == 0) {
    mb::RingPos p;
    for (unsigned long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
      if (!__all_sync(0xFFFFFFFFu, r.acquire(w, p))) break;
      if (lane == 0) mb::mbar_arrive_expect_tx(&r.full[p.stage], stage_bytes);
      __syncwarp();
      mb::fence_proxy_async_smem();  // the consumers' generic-proxy reads before the async-proxy copies
      if (lane < pieces)
        mb::bulk_g2s(r.slot(p.stage) + lane * piece, src + c * stage_bytes + lane * piece, piece, &r.full[p.stage]);
      p.advance(stages);
    }
  } else {
    acc = consume_stream<MODE_OK>(r, w, nchunks, stages, stage_bytes);
  }
  const uint32_t t = block_sum(acc, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = t;
}

// Item q of a list of experts: its source address and byte count.
struct Item {
  const unsigned char* src;
  uint32_t bytes;
};
__device__ __forceinline__ Item item_at(const unsigned char* experts, unsigned long long expert_bytes,
                                        uint32_t chunks_per_expert, uint32_t stage_bytes, const uint32_t* list,
                                        unsigned long long q) {
  const unsigned long long i = q / chunks_per_expert;
  const uint32_t k = (uint32_t)(q % chunks_per_expert);
  const unsigned long long off = (unsigned long long)k * stage_bytes;
  const unsigned long long left = expert_bytes - off;
  Item it;
  it.src = experts + (unsigned long long)list[i] * expert_bytes + off;
  it.bytes = left < stage_bytes ? (uint32_t)left : stage_bytes;
  return it;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(RING_MAX_THREADS, 1)
    mb_ring_stream(const unsigned char* __restrict__ src, unsigned long long nchunks, uint32_t stages,
                   uint32_t stage_bytes, uint32_t* __restrict__ out, unsigned long long* wd_rec,
                   unsigned long long bound_ns) {
  ring_stream<MODE_OK>(src, nchunks, stages, stage_bytes, out, wd_rec, bound_ns);
}
extern "C" __global__ void __launch_bounds__(RING_MAX_THREADS, 1)
    mb_ring_stream_skip(const unsigned char* __restrict__ src, unsigned long long nchunks, uint32_t stages,
                        uint32_t stage_bytes, uint32_t* __restrict__ out, unsigned long long* wd_rec,
                        unsigned long long bound_ns) {
  ring_stream<MODE_SKIP>(src, nchunks, stages, stage_bytes, out, wd_rec, bound_ns);
}
extern "C" __global__ void __launch_bounds__(RING_MAX_THREADS, 1)
    mb_ring_stream_short(const unsigned char* __restrict__ src, unsigned long long nchunks, uint32_t stages,
                         uint32_t stage_bytes, uint32_t* __restrict__ out, unsigned long long* wd_rec,
                         unsigned long long bound_ns) {
  ring_stream<MODE_SHORT>(src, nchunks, stages, stage_bytes, out, wd_rec, bound_ns);
}

extern "C" __global__ void __launch_bounds__(RING_MAX_THREADS, 1)
    mb_ring_stream_pieces(const unsigned char* __restrict__ src, unsigned long long nchunks, uint32_t stages,
                          uint32_t stage_bytes, uint32_t pieces, uint32_t* __restrict__ out, unsigned long long* wd_rec,
                          unsigned long long bound_ns) {
  ring_stream_pieces(src, nchunks, stages, stage_bytes, pieces, out, wd_rec, bound_ns);
}

extern "C" __global__ void __launch_bounds__(RING_MAX_THREADS, 1)
    mb_ring_phases(const unsigned char* __restrict__ experts, unsigned long long expert_bytes,
                   const uint32_t* __restrict__ pf_list, uint32_t n_pf, const uint32_t* __restrict__ rd_list,
                   uint32_t n_rd, const unsigned char* __restrict__ pa_src, unsigned long long pa_chunks,
                   unsigned long long busy_cycles, uint32_t stages, uint32_t stage_bytes,
                   uint32_t* __restrict__ out, unsigned long long* __restrict__ stamps, unsigned long long* wd_rec,
                   unsigned long long bound_ns) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint32_t scratch[32];
  const uint64_t c0 = mb::clock64();
  const uint64_t g0 = mb::globaltimer();
  const mb::Watchdog w{wd_rec, bound_ns};
  const uint32_t warp = threadIdx.x / 32;
  const bool producer = warp == 0 && mb::lane_id() == 0;
  const uint32_t ct = threadIdx.x - 32, nct = blockDim.x - 32;  // consumer thread index / count
  const uint32_t cpe = (uint32_t)((expert_bytes + stage_bytes - 1) / stage_bytes);
  const mb::Ring r = mb::Ring::carve(smem, stages, stage_bytes);
  if (threadIdx.x == 0) r.init(blockDim.x / 32 - 1);
  __syncthreads();
  // One walk through the ring for both phases: the positions carry over from A into B.
  mb::RingPos p;

  // ---- phase A: prefetch B's items into L2 (fire-and-forget), stream A's own chunks, busy-wait
  uint32_t acc_a = 0;
  if (warp == 0) {
    if (producer) {
      const unsigned long long npf = (unsigned long long)n_pf * cpe;
      for (unsigned long long q = blockIdx.x; q < npf; q += gridDim.x) {
        const Item it = item_at(experts, expert_bytes, cpe, stage_bytes, pf_list, q);
        mb::bulk_prefetch_l2(it.src, it.bytes);
      }
      for (unsigned long long c = blockIdx.x; c < pa_chunks; c += gridDim.x) {
        if (!r.acquire(w, p)) break;
        r.issue(p, pa_src + c * stage_bytes, stage_bytes);
        p.advance(stages);
      }
    }
    __syncwarp();
  } else {
    for (unsigned long long c = blockIdx.x; c < pa_chunks; c += gridDim.x) {
      if (!r.wait(w, p)) break;
      acc_a += consume_slot<MODE_OK>(r.slot(p.stage), stage_bytes, ct, nct);
      r.release_warp(p);
      p.advance(stages);
    }
    while (mb::clock64() - c0 < busy_cycles) {
    }
  }
  __syncthreads();
  const uint64_t g1 = mb::globaltimer();

  // ---- phase B: stream this block's share of the read list
  uint32_t acc_b = 0;
  const unsigned long long n = (unsigned long long)n_rd * cpe;
  if (warp == 0) {
    if (producer) {
      for (unsigned long long q = blockIdx.x; q < n; q += gridDim.x) {
        if (!r.acquire(w, p)) break;
        const Item it = item_at(experts, expert_bytes, cpe, stage_bytes, rd_list, q);
        r.issue(p, it.src, it.bytes);
        p.advance(stages);
      }
    }
    __syncwarp();
  } else {
    for (unsigned long long q = blockIdx.x; q < n; q += gridDim.x) {
      if (!r.wait(w, p)) break;
      const Item it = item_at(experts, expert_bytes, cpe, stage_bytes, rd_list, q);
      acc_b += consume_slot<MODE_OK>(r.slot(p.stage), it.bytes, ct, nct);
      r.release_warp(p);
      p.advance(stages);
    }
  }
  const uint32_t tb = block_sum(acc_b, scratch);
  const uint32_t ta = block_sum(acc_a, scratch);
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = tb;
    out[2 * blockIdx.x + 1] = ta;
    if (stamps) {
      stamps[3 * blockIdx.x] = g0;
      stamps[3 * blockIdx.x + 1] = g1;
      stamps[3 * blockIdx.x + 2] = mb::globaltimer();
    }
  }
}
