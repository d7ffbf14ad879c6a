// A shared-memory weight ring fed by bulk copies (cp.async.bulk global->shared on mbarriers).
//
// One producer thread streams chunks of global memory into `stages` slots of `stage_bytes`;
// consumer warps wait for a slot, read it, and release it. Per slot s:
//   full[s]  (count 1): the producer's arrive.expect_tx plus the copy's bytes complete a phase,
//                       i.e. "slot s holds fresh data";
//   empty[s] (count = consumer warps): one arrival per consumer warp completes a phase,
//                       i.e. "every consumer is done with slot s, it may be overwritten".
// Both sides walk the slots in the same order with a RingPos (slot, parity, lap), so no index
// is ever exchanged: the k-th chunk issued is the k-th chunk consumed.
//
// Every wait is bounded (mb::mbar_wait): a copy that never lands or a consumer that never
// releases ends in a watchdog record naming the ring, the slot and the lap instead of a hung SM.
// After a failed wait the caller must stop using the ring (break out of its loop) and still
// reach its block-wide barriers: every other waiter gives up once the record is set.
//
// Usage (one block per SM; warp 0 lane 0 produces, warps 1.. consume):
//   extern __shared__ __align__(128) unsigned char smem[];
//   mb::Ring r = mb::Ring::carve(smem, stages, stage_bytes);
//   if (threadIdx.x == 0) r.init(consumer_warps);
//   __syncthreads();
//   producer lane:  for each chunk { if (!r.acquire(w, p)) break; r.issue(p, src, bytes); p.advance(r.stages); }
//   consumer warp:  for each chunk { if (!r.wait(w, p)) break; ...read r.slot(p.stage)...;
//                                    r.release_warp(p); p.advance(r.stages); }
// Dynamic shared memory needed: ring_smem_bytes(stages, stage_bytes). The Python side
// (microbench/weights/plan.py) parses kRingMaxStages / kRingHeaderBytes / kRingMaxStageBytes
// from this file, so they are defined once, here.
#pragma once
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"

namespace mb {

constexpr uint32_t kRingMaxStages = 8;
constexpr uint32_t kRingHeaderBytes = 128;  // full[kRingMaxStages] + empty[kRingMaxStages], 8 B each
// One bulk copy per slot completes on an mbarrier whose tx-count holds at most 2^20 - 1 bytes.
constexpr uint32_t kRingMaxStageBytes = (1u << 20) - 16;
static_assert(2 * 8 * kRingMaxStages <= kRingHeaderBytes, "ring header too small for its barriers");
static_assert(kRingHeaderBytes % 128 == 0, "slots must start 128-byte aligned");

// Wait ids written to the watchdog record: 'R' tag | kind (1 = full, 2 = empty) | slot | lap.
constexpr uint32_t kRingWaitTag = 0x52000000u;
constexpr uint32_t kRingWaitFull = 1u, kRingWaitEmpty = 2u;
__host__ __device__ constexpr uint32_t ring_wait_id(uint32_t kind, uint32_t stage, uint32_t lap) {
  return kRingWaitTag | (kind << 20) | ((stage & 0xFu) << 16) | (lap & 0xFFFFu);
}

__host__ __device__ constexpr uint32_t ring_smem_bytes(uint32_t stages, uint32_t stage_bytes) {
  return kRingHeaderBytes + stages * stage_bytes;
}

// Position in the ring; producer and consumers each keep their own copy and advance it once
// per chunk, in the same order.
struct RingPos {
  uint32_t stage = 0;  // slot index
  uint32_t phase = 0;  // parity of this lap (flips each time the walk wraps around)
  uint32_t lap = 0;    // completed wraps; on lap 0 every slot is free without waiting
  __device__ __forceinline__ void advance(uint32_t stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
      ++lap;
    }
  }
};

struct Ring {
  unsigned char* data;  // stages * stage_bytes, 128-byte aligned
  uint64_t* full;
  uint64_t* empty;
  uint32_t stages;
  uint32_t stage_bytes;

  // Lays the ring out at `smem` (128-byte aligned dynamic shared memory of at least
  // ring_smem_bytes(stages, stage_bytes)). stages <= kRingMaxStages, stage_bytes a multiple
  // of 16 and <= kRingMaxStageBytes: the host plans and checks this (plan.py).
  __device__ __forceinline__ static Ring carve(void* smem, uint32_t stages, uint32_t stage_bytes) {
    Ring r;
    unsigned char* base = static_cast<unsigned char*>(smem);
    r.full = reinterpret_cast<uint64_t*>(base);
    r.empty = r.full + kRingMaxStages;
    r.data = base + kRingHeaderBytes;
    r.stages = stages;
    r.stage_bytes = stage_bytes;
    return r;
  }

  // ONE thread, before any use; the caller then __syncthreads() so every warp sees the barriers
  // initialised (and the async proxy does, through fence_mbar_init).
  __device__ __forceinline__ void init(uint32_t consumer_warps) const {
    for (uint32_t s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumer_warps);
    }
    fence_mbar_init();
  }

  __device__ __forceinline__ unsigned char* slot(uint32_t stage) const { return data + stage * stage_bytes; }

  // Producer (one thread): wait until every consumer released the slot's previous contents.
  // The first lap needs no wait. Returns false when the wait gave up (watchdog record set).
  __device__ __forceinline__ bool acquire(const Watchdog& w, const RingPos& p) const {
    if (p.lap == 0) return true;
    // completion number `lap` of empty[s] is phase lap-1, whose parity is phase ^ 1
    return mbar_wait(w, &empty[p.stage], p.phase ^ 1u, ring_wait_id(kRingWaitEmpty, p.stage, p.lap));
  }

  // Producer (the same thread, after acquire): copy `bytes` (multiple of 16, <= stage_bytes,
  // src 16-byte aligned) into the slot; the slot's full barrier completes when they land.
  __device__ __forceinline__ void issue(const RingPos& p, const void* src, uint32_t bytes) const {
    mbar_arrive_expect_tx(&full[p.stage], bytes);
    bulk_g2s(slot(p.stage), src, bytes, &full[p.stage]);
  }
  __device__ __forceinline__ void issue_hint(const RingPos& p, const void* src, uint32_t bytes,
                                             uint64_t policy) const {
    mbar_arrive_expect_tx(&full[p.stage], bytes);
    bulk_g2s_hint(slot(p.stage), src, bytes, &full[p.stage], policy);
  }

  // Consumer: EVERY lane of a consumer warp calls this (it ends in a warp vote, so the warp
  // leaves together: a lane that gave up alone would desynchronise the warp's later shuffles
  // and __syncwarp). Returns true when the slot's data is visible to this thread.
  __device__ __forceinline__ bool wait(const Watchdog& w, const RingPos& p) const {
    const bool ok = mbar_wait(w, &full[p.stage], p.phase, ring_wait_id(kRingWaitFull, p.stage, p.lap));
    return __all_sync(0xFFFFFFFFu, ok);
  }

  // Consumer: every lane of the warp calls this after its last read of the slot. __syncwarp
  // orders all lanes' reads before lane 0's arrival (release semantics), so the producer's
  // next bulk copy cannot overwrite bytes a lane has not read yet.
  __device__ __forceinline__ void release_warp(const RingPos& p) const {
    __syncwarp();
    if (lane_id() == 0) mbar_arrive(&empty[p.stage]);
  }
};

}  // namespace mb
