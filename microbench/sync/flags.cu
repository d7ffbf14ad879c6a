// Flag latency between SMs of one GPU (microbench/sync, benchmark sync.flags).
//
// sync_poll_load_*: one thread per SM runs dependent chains of single loads of a flag word
//   (v = ld(p + v), the word holds 0), for every load kind and many flag addresses (4 KB pages
//   all over a buffer, so many L2 slices). Timer: %clock64 around each chain.
// sync_pingpong_<scope>_<poll>: two blocks, chosen by %smid, bounce a monotonic counter: the
//   initiator writes ping = v and waits for pong >= v; the responder waits for ping >= v and
//   writes pong = v. Both sides stamp %clock64 (initiator: send and receive; responder: receive
//   and send) into shared memory; the initiator also reads %globaltimer around the measured
//   rounds (cross-check of the clock). Per-SM clocks differ by an offset only, so the host
//   estimates it from idle "calibration" rounds (assuming symmetric idle one-way latency) and
//   then splits loaded rounds into one-way latencies (initiator->responder and back).
//   Optional load: warp 1 of either side keeps k bytes of cp.async.bulk in flight (from the
//   calibration's end), or every other SM ("bystander") polls its own flag with a back-off or
//   streams bulk copies until the initiator releases it.
// Every wait is bounded by the watchdog (mb/spin.cuh): a missing partner or a lost copy ends the
// launch with a report naming what was awaited, never a hung GPU.
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"
#include "sync_common.cuh"

using namespace mbsync;
using mb::Scope;

// ------------------------------------------------------------------ single-load latency
enum PLParam : int { PL_FLAGS = 0, PL_OFFS, PL_NADDR, PL_CHAIN, PL_OUT, PL_SMIDS, PL_NPARAMS };
enum LoadKind : int { LK_ACQ_GPU = 0, LK_ACQ_SYS, LK_RLX_GPU, LK_RLX_SYS, LK_VOLATILE, LK_WEAK_CA, LK_CG, LK_KINDS };

template <int K> __device__ __forceinline__ uint32_t ld_kind(const uint32_t* p) {
  if constexpr (K == LK_ACQ_GPU) return mb::ld_acquire_gpu(p);
  else if constexpr (K == LK_ACQ_SYS) return mb::ld_acquire_sys(p);
  else if constexpr (K == LK_RLX_GPU) return mb::ld_relaxed_gpu(p);
  else if constexpr (K == LK_RLX_SYS) return mb::ld_relaxed_sys(p);
  else if constexpr (K == LK_VOLATILE) return mb::ld_volatile(p);
  else if constexpr (K == LK_WEAK_CA) return mb::ld_weak_ca_u32(p);
  else return mb::ld_cg_u32(p);
}

// n dependent loads of the same word (it holds 0, so p + v == p, but the compiler cannot know).
template <int K> __device__ __forceinline__ uint64_t chain(const uint32_t* p, uint32_t n, uint32_t& v) {
  const uint64_t t0 = mb::clock64();
#pragma unroll 1
  for (uint32_t j = 0; j < n; ++j) v = ld_kind<K>(p + v);
  return mb::clock64() - t0;
}

template <int K> __device__ __forceinline__ void poll_load_kind(const uint64_t* P, uint32_t& sink) {
  const uint32_t* flags = reinterpret_cast<const uint32_t*>(P[PL_FLAGS]);
  const uint32_t* offs = reinterpret_cast<const uint32_t*>(P[PL_OFFS]);
  const uint32_t naddr = static_cast<uint32_t>(P[PL_NADDR]), n = static_cast<uint32_t>(P[PL_CHAIN]);
  uint32_t* out = reinterpret_cast<uint32_t*>(P[PL_OUT]);
  for (uint32_t a = 0; a < naddr; ++a) {
    const uint32_t aa = (a + blockIdx.x) % naddr;  // SMs visit addresses staggered: no two on one line
    const uint32_t* p = flags + offs[aa];
    uint32_t v = 0;
    (void)chain<K>(p, 2, v);  // warm: TLB and (for the weak kind) L1
    const uint64_t c = chain<K>(p + v, n, v);
    out[(static_cast<size_t>(blockIdx.x) * LK_KINDS + K) * naddr + aa] = static_cast<uint32_t>(c);
    sink ^= v;
  }
}

extern "C" __global__ void __launch_bounds__(32) sync_poll_load(const uint64_t* P) {
  if (threadIdx.x != 0) return;
  reinterpret_cast<uint32_t*>(P[PL_SMIDS])[blockIdx.x] = mb::smid();
  uint32_t sink = 0;
  poll_load_kind<LK_ACQ_GPU>(P, sink);
  poll_load_kind<LK_ACQ_SYS>(P, sink);
  poll_load_kind<LK_RLX_GPU>(P, sink);
  poll_load_kind<LK_RLX_SYS>(P, sink);
  poll_load_kind<LK_VOLATILE>(P, sink);
  poll_load_kind<LK_WEAK_CA>(P, sink);
  poll_load_kind<LK_CG>(P, sink);
  if (sink == 0xDEADBEEFu) reinterpret_cast<uint32_t*>(P[PL_SMIDS])[0] = sink;  // keeps the loads live
}

// ------------------------------------------------------------------ ping-pong
enum PPParam : int {
  PP_PING = 0,         // u32* initiator writes, responder polls (lives in the responder's memory)
  PP_PONG,             // u32* responder writes, initiator polls (lives in the initiator's memory)
  PP_SM_INIT,          // %smid of the initiator, or NONE (played by another launch / GPU)
  PP_SM_RESP,          // %smid of the responder, or NONE
  PP_WARMUP,           // unrecorded rounds
  PP_CALIB,            // recorded idle rounds (clock-offset calibration)
  PP_SETTLE,           // recorded rounds right after the load starts (host discards them)
  PP_ROUNDS,           // measured rounds
  PP_BASE,             // flags are monotonic across launches: round i writes base + i + 1
  PP_WRITE_RELEASE,    // 1: st.release flag writes, 0: st.relaxed
  PP_BACKOFF_NS,       // nanosleep between probes of the pair's polls
  PP_OUT,              // u64 [2 sides][2 * nrec] clock64 stamps
  PP_META,             // u64 [2 sides][PM_FIELDS] + [1] bystander count
  PP_CLAIM,            // u32 [2] zeroed role claims (distinct per launch)
  PP_WD,               // watchdog record
  PP_BOUND_NS,         // watchdog bound
  PP_SMEM_BYTES,       // dynamic shared memory given to the launch
  PP_LOAD_SIDES,       // bit 0: initiator SM loads, bit 1: responder SM loads
  PP_LOAD_BYTES,       // k: bytes of bulk copies kept in flight (pair sides and bystander loaders)
  PP_LOAD_SRC,         // u8* source buffer of the loaders
  PP_LOAD_SRC_BYTES,
  PP_BYST_MODE,        // BY_NONE / BY_POLL / BY_LOAD for blocks that play no role
  PP_BYST_WARPS,       // polling warps per bystander block (BY_POLL)
  PP_BYST_BACKOFF_NS,  // their nanosleep between probes
  PP_BYST_FLAGS,       // u32* lines (32-word stride), [block * 16 + warp]; released at the end
  PP_BYST_TARGET,      // value the initiator writes into every bystander line when done
  PP_NPARAMS
};
enum PPMeta : int {
  PM_SMID = 0, PM_GT_START, PM_GT_END, PM_CYC_START, PM_CYC_END, PM_POLLS, PM_LOAD_BYTES, PM_LOAD_NS, PM_STATUS,
  PM_FIELDS
};
enum PPStatus : int { ST_NOT_RUN = 0, ST_OK = 1, ST_TIMEOUT = 2, ST_BAD_SMEM = 3 };
enum BystMode : int { BY_NONE = 0, BY_POLL = 1, BY_LOAD = 2 };
constexpr uint32_t BYST_LINES_PER_BLOCK = 16;
constexpr uint32_t PP_THREADS = 256;

template <Scope S, int POLL> __device__ __forceinline__ void pingpong(const uint64_t* P) {
  __shared__ int role_s;
  __shared__ volatile uint32_t go_s, stop_s;
  extern __shared__ __align__(128) uint8_t dsm[];
  const mb::Watchdog w{reinterpret_cast<unsigned long long*>(P[PP_WD]), P[PP_BOUND_NS]};
  uint64_t* meta = reinterpret_cast<uint64_t*>(P[PP_META]);
  const uint32_t calib = static_cast<uint32_t>(P[PP_CALIB]), settle = static_cast<uint32_t>(P[PP_SETTLE]);
  const uint32_t nrec = calib + settle + static_cast<uint32_t>(P[PP_ROUNDS]);
  const uint32_t k = static_cast<uint32_t>(P[PP_LOAD_BYTES]);
  const uint32_t rec_bytes = (2u * nrec * 8u + 127u) & ~127u;
  uint64_t* rec = reinterpret_cast<uint64_t*>(dsm);
  uint64_t* bars = reinterpret_cast<uint64_t*>(dsm + rec_bytes);
  uint8_t* ring = dsm + rec_bytes + 128;
  const bool smem_ok = rec_bytes + 128u + k <= static_cast<uint32_t>(P[PP_SMEM_BYTES]);
  if (threadIdx.x == 0) {
    role_s = claim_role(&P[PP_SM_INIT], 1, 2, reinterpret_cast<uint32_t*>(P[PP_CLAIM]));
    go_s = 0;
    stop_s = 0;
  }
  __syncthreads();
  const int role = role_s;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(P[PP_LOAD_SRC]);
  const uint64_t src_bytes = P[PP_LOAD_SRC_BYTES];

  if (role < 0) {  // ------------------------------------------------ bystander
    const uint32_t mode = static_cast<uint32_t>(P[PP_BYST_MODE]);
    if (mode == BY_NONE) return;
    uint32_t* lines = reinterpret_cast<uint32_t*>(P[PP_BYST_FLAGS]);
    const uint32_t target = static_cast<uint32_t>(P[PP_BYST_TARGET]);
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&meta[2 * PM_FIELDS]), 1ull);
    const uint32_t* line = lines + (static_cast<size_t>(blockIdx.x) * BYST_LINES_PER_BLOCK + warp) * 32;
    if (mode == BY_POLL && lane == 0 && warp < static_cast<uint32_t>(P[PP_BYST_WARPS])) {
      uint32_t polls = 0;
      (void)poll_geq<S, POLL_ACQ>(w, line, target, what_id(SW_BYSTANDER, blockIdx.x), static_cast<uint32_t>(P[PP_BYST_BACKOFF_NS]), polls);
    } else if (mode == BY_LOAD && threadIdx.x == 32 && smem_ok && k > 0) {
      const uint64_t off = (static_cast<uint64_t>(blockIdx.x) << 21) % (src_bytes ? src_bytes : 1);
      (void)run_loader(w, ring, bars, k, src, src_bytes, off, &stop_s, line, target);
    }
    return;
  }

  // ------------------------------------------------------------------ pair roles
  uint64_t* m = meta + role * PM_FIELDS;
  const bool loaded = (static_cast<uint32_t>(P[PP_LOAD_SIDES]) >> role) & 1u;
  if (!smem_ok) {
    if (threadIdx.x == 0) m[PM_STATUS] = ST_BAD_SMEM;
    return;  // the partner's waits time out and name this launch
  }
  if (threadIdx.x == 32 && loaded && k > 0) {  // ------------------- loader warp
    if (!wait_smem_nonzero(w, &go_s, what_id(SW_GO, role))) return;
    const uint64_t off = (static_cast<uint64_t>(mb::smid()) << 21) % (src_bytes ? src_bytes : 1);
    const LoaderStats ls = run_loader(w, ring, bars, k, src, src_bytes, off, &stop_s,
                                      nullptr, 0);
    m[PM_LOAD_BYTES] = ls.bytes;
    m[PM_LOAD_NS] = ls.ns;
    return;
  }
  if (threadIdx.x != 0) return;

  // ------------------------------------------------------------------ measuring thread
  uint32_t* ping = reinterpret_cast<uint32_t*>(P[PP_PING]);
  uint32_t* pong = reinterpret_cast<uint32_t*>(P[PP_PONG]);
  const uint32_t warm = static_cast<uint32_t>(P[PP_WARMUP]), base = static_cast<uint32_t>(P[PP_BASE]);
  const uint32_t total = warm + nrec, backoff = static_cast<uint32_t>(P[PP_BACKOFF_NS]);
  const bool rel = P[PP_WRITE_RELEASE] != 0;
  uint32_t polls = 0;
  bool ok = true;
  uint64_t gt0 = mb::globaltimer(), c0 = mb::clock64();
  for (uint32_t i = 0; i < total; ++i) {
    const uint32_t v = base + i + 1;
    const int32_t j = static_cast<int32_t>(i) - static_cast<int32_t>(warm);
    if (j == static_cast<int32_t>(calib)) go_s = 1;  // the loader (if any) starts after calibration
    if (j == static_cast<int32_t>(calib + settle)) {
      polls = 0;
      gt0 = mb::globaltimer();
      c0 = mb::clock64();
    }
    uint64_t ta, tb;
    if (role == 0) {
      ta = mb::clock64();
      if (rel) mb::st_release<S>(ping, v); else mb::st_relaxed<S>(ping, v);
      ok = poll_geq<S, POLL>(w, pong, v, what_id(SW_PONG, i), backoff, polls);
      tb = mb::clock64();
    } else {
      ok = poll_geq<S, POLL>(w, ping, v, what_id(SW_PING, i), backoff, polls);
      ta = mb::clock64();
      tb = mb::clock64();
      if (rel) mb::st_release<S>(pong, v); else mb::st_relaxed<S>(pong, v);
    }
    if (!ok) break;
    if (j >= 0) {
      rec[2 * j] = ta;
      rec[2 * j + 1] = tb;
    }
  }
  const uint64_t c1 = mb::clock64(), gt1 = mb::globaltimer();
  stop_s = 1;
  go_s = 1;  // a loader still waiting for its start must not time out
  uint64_t* out = reinterpret_cast<uint64_t*>(P[PP_OUT]) + static_cast<size_t>(role) * 2 * nrec;
  for (uint32_t q = 0; q < 2 * nrec; ++q) out[q] = rec[q];
  m[PM_SMID] = mb::smid();
  m[PM_GT_START] = gt0;
  m[PM_GT_END] = gt1;
  m[PM_CYC_START] = c0;
  m[PM_CYC_END] = c1;
  m[PM_POLLS] = polls;
  m[PM_STATUS] = ok ? ST_OK : ST_TIMEOUT;
  // Release this GPU's bystanders (also after a failure): the initiator does, or the responder
  // where the initiator plays on another GPU (its lines are in that GPU's memory).
  if ((role == 0 || static_cast<uint32_t>(P[PP_SM_INIT]) == NONE) && P[PP_BYST_MODE] != BY_NONE) {
    uint32_t* lines = reinterpret_cast<uint32_t*>(P[PP_BYST_FLAGS]);
    const uint32_t n = gridDim.x * BYST_LINES_PER_BLOCK, target = static_cast<uint32_t>(P[PP_BYST_TARGET]);
    for (uint32_t q = 0; q < n; ++q) mb::st_relaxed<S>(lines + static_cast<size_t>(q) * 32, target);
  }
}

extern "C" __global__ void __launch_bounds__(PP_THREADS, 1) sync_pingpong_gpu_acq(const uint64_t* P) {
  MB_INJECT_SCOPE();  // the gate's calibrated slowdown (mb/inject.cuh)
  pingpong<Scope::gpu, POLL_ACQ>(P);
}
extern "C" __global__ void __launch_bounds__(PP_THREADS, 1) sync_pingpong_gpu_rlxacq(const uint64_t* P) {
  MB_INJECT_SCOPE();  // the gate's calibrated slowdown (mb/inject.cuh)
  pingpong<Scope::gpu, POLL_RLX_ACQ>(P);
}
extern "C" __global__ void __launch_bounds__(PP_THREADS, 1) sync_pingpong_sys_acq(const uint64_t* P) {
  MB_INJECT_SCOPE();  // the gate's calibrated slowdown (mb/inject.cuh)
  pingpong<Scope::sys, POLL_ACQ>(P);
}
extern "C" __global__ void __launch_bounds__(PP_THREADS, 1) sync_pingpong_sys_rlxacq(const uint64_t* P) {
  MB_INJECT_SCOPE();  // the gate's calibrated slowdown (mb/inject.cuh)
  pingpong<Scope::sys, POLL_RLX_ACQ>(P);
}

// A minimal poll loop for the SASS check: its only loop is the bounded poll of spin_geq.
extern "C" __global__ void sync_poll_probe_gpu(const uint32_t* flag, uint32_t target, unsigned long long* wd,
                                               unsigned long long bound_ns, uint32_t* out) {
  const mb::Watchdog w{wd, bound_ns};
  out[0] = mb::spin_geq(w, flag, target, 1u) ? 1u : 2u;
}
extern "C" __global__ void sync_poll_probe_sys(const uint32_t* flag, uint32_t target, unsigned long long* wd,
                                               unsigned long long bound_ns, uint32_t* out) {
  const mb::Watchdog w{wd, bound_ns};
  out[0] = mb::spin_geq_sys(w, flag, target, 1u) ? 1u : 2u;
}

// ------------------------------------------------------------------ topology and clocks
// Blocks of one cluster share a GPC: each block reports its SM and its rank in the cluster; the
// host unions SMs that met in a cluster into GPC groups.
extern "C" __global__ void sync_cluster_probe(uint32_t* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = mb::smid() | (mb::cluster_ctarank() << 16);
}

// Busy for `ns` on every SM (bounded by construction) so the SM clock ramps up before timing.
extern "C" __global__ void sync_heat(unsigned long long ns, float* sink) {
  const float x = heat_body(ns);
  if (x == 12345.0f) sink[0] = x;
}
