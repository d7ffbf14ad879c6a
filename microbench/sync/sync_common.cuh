// Shared pieces of the sync microbenchmarks: role claiming by SM, counted bounded polls, the
// bulk-copy loader that keeps k bytes in flight, and what-ids for watchdog reports.
//
// Kernels read their parameters from a u64 "parameter block" in global memory, indexed by the
// enums in each .cu file; microbench/sync/params.py parses those enums (single source).
#pragma once
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"

namespace mbsync {

using mb::Scope;
constexpr uint32_t NONE = 0xFFFFFFFFu;  // "no SM plays this role in this launch"

// Watchdog what-ids: (kind << 24) | (index & 0xFFFFFF). params.py parses this enum.
enum SyncWait : int {
  SW_PING = 1,         // responder waiting for the initiator's ping; index = round
  SW_PONG = 2,         // initiator waiting for the responder's pong; index = round
  SW_BYSTANDER = 3,    // bystander warp waiting for the end-of-launch flag
  SW_LOADER_MBAR = 4,  // bulk loader waiting for a copy to land; index = stage
  SW_LOADER_RUN = 5,   // bulk loader never told to stop
  SW_GO = 6,           // loader / fence probe waiting for its start signal
  SW_FLAG = 7,         // publish: waiting for a data flag; index = round
  SW_SLOT = 8,         // publish: waiting for a sentinel slot; index = round (address names the slot)
  SW_ACK = 9,          // publish: producer waiting for a copy to be freed; index = round
  SW_BARRIER = 10,     // atomic-counter barrier; index = stop
  SW_DEP = 11,         // per-dependency flag; index = stop
  SW_SYNC_WAIT_END = 12
};
__device__ __forceinline__ uint32_t what_id(uint32_t kind, uint32_t index) { return (kind << 24) | (index & 0xFFFFFFu); }

// Poll kinds of a flag wait: acquire on every probe (LDG.STRONG + L1 invalidate each time), or
// relaxed probes and one acquire load once the value is there.
enum PollKind : int { POLL_ACQ = 0, POLL_RLX_ACQ = 1 };

// Bounded wait until (int32)(*flag - target) >= 0, counting probes (the polling traffic).
template <Scope S, int POLL>
__device__ __forceinline__ bool poll_geq(const mb::Watchdog& w, const uint32_t* flag, uint32_t target, uint32_t what,
                                         uint32_t backoff_ns, uint32_t& polls) {
  const bool ok = mb::spin_until(
      w, what, flag, target,
      [&](uint64_t& seen) {
        ++polls;
        const uint32_t v = (POLL == POLL_ACQ) ? mb::ld_acquire<S>(flag) : mb::ld_relaxed<S>(flag);
        seen = v;
        return static_cast<int32_t>(v - target) >= 0;
      },
      backoff_ns);
  if (POLL == POLL_RLX_ACQ && ok) (void)mb::ld_acquire<S>(flag);  // the acquire the relaxed probes lacked
  return ok;
}

// Bounded wait on a shared-memory word written by another warp of this block.
__device__ __forceinline__ bool wait_smem_nonzero(const mb::Watchdog& w, const volatile uint32_t* p, uint32_t what) {
  return mb::spin_until(w, what, (const void*)p, 1, [&](uint64_t& seen) {
    seen = *p;
    return seen != 0;
  });
}

// The first thread of the block whose SM is sms[a] claims role a (first claimant wins; a second
// block on the same SM gets -1). Returns the role or -1.
__device__ __forceinline__ int claim_role(const uint64_t* sms, uint32_t stride, uint32_t n, uint32_t* claims) {
  const uint32_t me = mb::smid();
  for (uint32_t a = 0; a < n; ++a)
    if (static_cast<uint32_t>(sms[a * stride]) == me && atomicCAS(&claims[a], 0u, 1u) == 0u) return static_cast<int>(a);
  return -1;
}

// ---------------------------------------------------------------- bulk loader
// One thread keeps `k` bytes of cp.async.bulk global->shared in flight: `stages` copies of
// `chunk` bytes, each re-issued as soon as it lands, reading a `src_bytes` buffer cyclically
// (from `off`). Stops when *stop_smem != 0, or (if stop_gmem) when *stop_gmem >= stop_target,
// then drains every copy still in flight: a block must not exit with bulk copies landing in its
// shared memory. Bounded: gives up (watchdog report) after w.bound_ns. Returns bytes landed.
constexpr uint32_t LOADER_MAX_STAGES = 16;
__host__ __device__ constexpr uint32_t loader_chunk(uint32_t k) { return k >= 65536u ? 16384u : k / 4u; }

struct LoaderStats {
  uint64_t bytes;
  uint64_t ns;
};

__device__ __noinline__ LoaderStats run_loader(const mb::Watchdog& w, uint8_t* ring, uint64_t* bars, uint32_t k,
                                               const uint8_t* src, uint64_t src_bytes, uint64_t off,
                                               const volatile uint32_t* stop_smem, const uint32_t* stop_gmem,
                                               uint32_t stop_target) {
  LoaderStats st{0, 0};
  const uint32_t chunk = loader_chunk(k);
  if (k == 0 || chunk < 16 || chunk % 16 != 0 || k % chunk != 0 || k / chunk > LOADER_MAX_STAGES) return st;
  const uint32_t stages = k / chunk;
  if (off + chunk > src_bytes) off = 0;
  for (uint32_t s = 0; s < stages; ++s) mb::mbar_init(&bars[s], 1);
  mb::fence_mbar_init();
  auto issue = [&](uint32_t s) {
    mb::mbar_arrive_expect_tx(&bars[s], chunk);
    mb::bulk_g2s(ring + static_cast<size_t>(s) * chunk, src + off, chunk, &bars[s]);
    off += chunk;
    if (off + chunk > src_bytes) off = 0;
  };
  for (uint32_t s = 0; s < stages; ++s) issue(s);
  uint32_t parity = 0;  // bit s: phase parity the next wait on stage s expects
  const uint64_t t0 = mb::globaltimer();
  // Waits for the `count` stages after `s` (cyclically, ending at s itself when count == stages).
  auto drain = [&](uint32_t s, uint32_t count) {
    for (uint32_t j = 1; j <= count; ++j) {
      const uint32_t q = (s + j) % stages;
      if (!mb::mbar_wait(w, &bars[q], (parity >> q) & 1u, what_id(SW_LOADER_MBAR, q))) break;
      parity ^= 1u << q;
      st.bytes += chunk;
    }
    st.ns = mb::globaltimer() - t0;
  };
  uint32_t s = 0;
  for (uint32_t i = 0;; ++i) {
    if (!mb::mbar_wait(w, &bars[s], (parity >> s) & 1u, what_id(SW_LOADER_MBAR, s))) {
      st.ns = mb::globaltimer() - t0;
      return st;  // a copy never landed (reported); the others cannot be trusted either
    }
    parity ^= 1u << s;
    st.bytes += chunk;
    if (*stop_smem != 0u) {  // stage s is idle: drain the other stages-1
      drain(s, stages - 1);
      return st;
    }
    issue(s);  // re-issue first, so k bytes stay in flight while we look at the stop signals
    bool stop = stop_gmem && (i & 7u) == 0u && static_cast<int32_t>(mb::ld_relaxed_gpu(stop_gmem) - stop_target) >= 0;
    const uint64_t dt = mb::globaltimer() - t0;
    if (!stop && dt > w.bound_ns) {
      mb::wd_report(w, what_id(SW_LOADER_RUN, 0), stop_gmem ? (const void*)stop_gmem : (const void*)stop_smem,
                    stop_target, 0, dt);
      stop = true;
    }
    if (!stop && (i & 63u) == 0u && mb::wd_tripped(w)) stop = true;
    if (stop) {  // every stage, s included, has one copy in flight
      drain(s, stages);
      return st;
    }
    s = (s + 1 == stages) ? 0 : s + 1;
  }
}

// A busy kernel body: keeps SMs active for `ns` so the SM clock ramps before in-kernel timing.
__device__ __forceinline__ float heat_body(uint64_t ns) {
  const uint64_t t0 = mb::globaltimer();
  float x = threadIdx.x * 1e-3f, y = 1.0001f;
  while (mb::globaltimer() - t0 < ns) {
#pragma unroll 16
    for (int i = 0; i < 64; ++i) x = fmaf(x, y, 1e-7f);
  }
  return x;
}

}  // namespace mbsync
