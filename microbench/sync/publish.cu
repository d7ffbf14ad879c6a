// Publishing a payload from one block to others (benchmark sync.publish).
//
// Three ways to say "the data is there":
//   PUB_FENCE_FLAG   data stores, __syncthreads, fence.acq_rel.<scope>, relaxed flag store
//   PUB_RELEASE_FLAG data stores, __syncthreads, st.release.<scope> flag store
//   PUB_SENTINEL     data stores of canonicalised values into sentinel slots (mb/sentinel.cuh):
//                    no flag and no fence on the data path; the reader polls every element.
// Flags are monotonic counters (round r writes r+1): never reset, so no reset race. Sentinel
// slots are double (or triple) buffered and reset by their reader (ordering: mb/sentinel.cuh).
//
// Agents: a table of {SM, receive slots, receive flags, acks}; every pointer may be peer memory
// (the multi-GPU issue passes another GPU's buffers; Scope::sys then). A block whose %smid is
// an agent's SM plays that agent; blocks on other SMs exit. Writers push into the reader's
// memory; every poll reads the poller's own memory.
//
// Patterns (per launch: warmup + rounds, absolute round r = base + it):
//   PAT_PING      agent 0 publishes to 1; 1 consumes then publishes back; 0 consumes. One round
//                 is a round trip (one-way = round / 2).
//   PAT_STREAM    agent 0 publishes round after round; 1 consumes and returns the copy with a
//                 release-stored ack; 0 acquires the ack before reusing a copy. Throughput.
//   PAT_ALLTOALL  every agent publishes to every other, then consumes from every other.
// PB_NOSYNC moves the same bytes with every wait, flag and ack removed (flag kernels only): the
// bound the synchronised variants are judged against.
// Verify mode (PB_SRC != 0): payloads come from PB_SRC and every received message is written
// to PB_DST; the host compares bit-exactly against the Python sentinel rules. Timed mode: cheap
// generated payloads, received data folded into a sink.
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"
#include "mb/sentinel.cuh"
#include "sync_common.cuh"

using namespace mbsync;
using mb::Scope;
namespace sn = mb::sentinel;

enum PBParam : int {
  PB_AGENTS = 0,   // u64 [N][AG_FIELDS]
  PB_N,            // agents (2..16)
  PB_PATTERN,      // PAT_*
  PB_BYTES,        // payload bytes per message (multiple of 16; 0 = flag only, flag kernels)
  PB_STRIDE,       // bytes between consecutive copies (>= PB_BYTES, multiple of 128)
  PB_COPIES,       // 2 or 3
  PB_WARMUP,       // unrecorded rounds
  PB_ROUNDS,       // recorded rounds
  PB_BASE,         // absolute number of the first round (flags/acks continue across launches)
  PB_SRC,          // u8* [it][sender][receiver][bytes] payloads (verify), or 0
  PB_DST,          // u8* [it][sender][receiver][bytes] as received (verify), or 0
  PB_OUT,          // u64 [N][rounds] %clock64 at the end of each recorded round
  PB_META,         // u64 [N][PBM_FIELDS]
  PB_CLAIM,        // u32 [N] zeroed role claims
  PB_WD,
  PB_BOUND_NS,
  PB_SMEM_BYTES,
  PB_BREAK,        // BRK_* (tests: prove the checkers fail)
  PB_NOSYNC,       // 1: no synchronisation at all (the data-movement bound)
  PB_NPARAMS
};
enum AgentField : int { AG_SM = 0, AG_SLOTS, AG_FLAGS, AG_ACKS, AG_FIELDS };
enum Pattern : int { PAT_PING = 0, PAT_STREAM = 1, PAT_ALLTOALL = 2 };
enum PubMode : int { PUB_FENCE_FLAG = 0, PUB_RELEASE_FLAG = 1, PUB_SENTINEL = 2 };
enum PBMeta : int { PBM_SMID = 0, PBM_STATUS, PBM_GT_START, PBM_GT_END, PBM_CYC_START, PBM_CYC_END, PBM_SINK, PBM_FIELDS };
enum PBStatus : int { PBS_NOT_RUN = 0, PBS_OK = 1, PBS_TIMEOUT = 2, PBS_BAD_SMEM = 3, PBS_BAD_ARGS = 4 };
enum BreakMode : int { BRK_NONE = 0, BRK_SKIP_ENCODE = 1, BRK_CORRUPT = 2 };
constexpr uint32_t PB_THREADS = 256;
constexpr uint32_t PB_MAX_AGENTS = 16;

template <class Fmt> __device__ __forceinline__ uint32_t corrupt_word(uint32_t e) {
  uint32_t c = e ^ 0x10000u;  // flips bit 16; if that made the empty pattern, flip bit 17 instead
  if (!Fmt::ready(c)) c = e ^ 0x20000u;
  return c;
}

template <int MODE, class Fmt, Scope S> __device__ __forceinline__ void publish_kernel(const uint64_t* P) {
  __shared__ int role_s;
  __shared__ int fail_s;
  // The agent table, copied into shared memory once: reading it from global memory inside the
  // round loop would cost an L2 round trip per access (acquire polls and fences invalidate L1).
  __shared__ uint8_t* slots_s[PB_MAX_AGENTS];
  __shared__ uint32_t* flags_s[PB_MAX_AGENTS];
  __shared__ uint32_t* acks_s[PB_MAX_AGENTS];
  extern __shared__ __align__(16) uint64_t rec[];
  const uint64_t* ag = reinterpret_cast<const uint64_t*>(P[PB_AGENTS]);
  const uint32_t N = static_cast<uint32_t>(P[PB_N]);
  const uint32_t tid = threadIdx.x, T = blockDim.x;
  if (tid == 0) {
    role_s = (N >= 2 && N <= PB_MAX_AGENTS) ? claim_role(ag + AG_SM, AG_FIELDS, N, reinterpret_cast<uint32_t*>(P[PB_CLAIM])) : -1;
    fail_s = 0;
  }
  if (tid < PB_MAX_AGENTS) {
    const bool in = tid < N && N <= PB_MAX_AGENTS;
    slots_s[tid] = in ? reinterpret_cast<uint8_t*>(ag[tid * AG_FIELDS + AG_SLOTS]) : nullptr;
    flags_s[tid] = in ? reinterpret_cast<uint32_t*>(ag[tid * AG_FIELDS + AG_FLAGS]) : nullptr;
    acks_s[tid] = in ? reinterpret_cast<uint32_t*>(ag[tid * AG_FIELDS + AG_ACKS]) : nullptr;
  }
  __syncthreads();
  const int a = role_s;
  if (a < 0) return;
  const mb::Watchdog w{reinterpret_cast<unsigned long long*>(P[PB_WD]), P[PB_BOUND_NS]};
  uint64_t* meta = reinterpret_cast<uint64_t*>(P[PB_META]) + static_cast<size_t>(a) * PBM_FIELDS;
  const uint32_t pattern = static_cast<uint32_t>(P[PB_PATTERN]);
  const uint32_t bytes = static_cast<uint32_t>(P[PB_BYTES]), n16 = bytes / 16;
  const uint64_t stride = P[PB_STRIDE];
  const uint32_t C = static_cast<uint32_t>(P[PB_COPIES]);
  const uint32_t W = static_cast<uint32_t>(P[PB_WARMUP]), R = static_cast<uint32_t>(P[PB_ROUNDS]);
  const uint32_t base = static_cast<uint32_t>(P[PB_BASE]);
  const uint4* src = reinterpret_cast<const uint4*>(P[PB_SRC]);
  uint4* dst = reinterpret_cast<uint4*>(P[PB_DST]);
  const uint32_t brk = static_cast<uint32_t>(P[PB_BREAK]);
  const bool nosync = P[PB_NOSYNC] != 0;
  if (R * 8ull > P[PB_SMEM_BYTES]) {
    if (tid == 0) meta[PBM_STATUS] = PBS_BAD_SMEM;
    return;
  }
  const bool bad_args = bytes % 16 != 0 || stride < bytes || stride % 128 != 0 || C < 2 || C > 3 ||
                        (MODE == PUB_SENTINEL && (bytes == 0 || nosync)) ||
                        (pattern != PAT_ALLTOALL && N != 2) || pattern > PAT_ALLTOALL;
  if (bad_args) {
    if (tid == 0) meta[PBM_STATUS] = PBS_BAD_ARGS;
    return;  // partners time out and the host names the bad arguments
  }

  auto slot_of = [&](uint32_t receiver, uint32_t sender, uint32_t r) -> uint8_t* {
    return slots_s[receiver] + (static_cast<uint64_t>(sender) * C) * stride + sn::copy_offset(r, C, stride);
  };
  auto flag_of = [&](uint32_t receiver, uint32_t sender) -> uint32_t* { return flags_s[receiver] + sender * 32u; };
  auto ack_of = [&](uint32_t sender, uint32_t receiver) -> uint32_t* { return acks_s[sender] + receiver * 32u; };
  auto payload = [&](uint32_t it, uint32_t r, uint32_t from, uint32_t to, uint32_t v) -> uint4 {
    if (src) return src[((static_cast<size_t>(it) * N + from) * N + to) * n16 + v];
    const uint32_t h = r * 0x9E3779B1u ^ (from << 20) ^ (to << 26) ^ v * 0x85EBCA77u;
    return make_uint4(h, h ^ 0x55555555u, h + 1u, ~h);
  };

  // ---- block-wide steps
  auto put_data = [&](uint32_t it, uint32_t r, uint32_t to) {
    uint8_t* slot = slot_of(to, a, r);
    for (uint32_t v = tid; v < n16; v += T) {
      uint4 x = payload(it, r, a, to, v);
      if (MODE == PUB_SENTINEL && brk != BRK_SKIP_ENCODE) x = sn::encode16<Fmt>(x);
      if (brk == BRK_CORRUPT && it == R / 2 && a == 0 && v == 0) x.x = corrupt_word<Fmt>(x.x);
      mb::st_relaxed_v4<S>(slot + static_cast<size_t>(v) * 16, x);
    }
  };
  auto release_flag = [&](uint32_t r, uint32_t to) {  // one thread; after a __syncthreads
    uint32_t* f = flag_of(to, a);
    if (MODE == PUB_FENCE_FLAG) {
      mb::fence_acq_rel<S>();
      mb::st_relaxed<S>(f, r + 1);
    } else {
      mb::st_release<S>(f, r + 1);
    }
  };
  uint32_t sink = 0, polls = 0;
  auto acquire_flag = [&](uint32_t it, uint32_t r, uint32_t from) {  // one thread
    if (!poll_geq<S, POLL_ACQ>(w, flag_of(a, from), r + 1, what_id(SW_FLAG, it), 0, polls)) fail_s = 1;
  };
  // Reads one message, four 16-byte vectors per thread in flight (the same batching for every
  // scheme); sentinel slots re-poll only the vectors that were still empty.
  auto get_data = [&](uint32_t it, uint32_t r, uint32_t from) {
    const uint4* slot = reinterpret_cast<const uint4*>(slot_of(a, from, r));
    uint4* d = dst ? dst + ((static_cast<size_t>(it) * N + from) * N + a) * n16 : nullptr;
    for (uint32_t v0 = tid; v0 < n16; v0 += 4 * T) {
      uint4 x[4];
#pragma unroll
      for (uint32_t u = 0; u < 4; ++u)
        if (v0 + u * T < n16) x[u] = mb::ld_relaxed_v4<S>(slot + v0 + u * T);
#pragma unroll
      for (uint32_t u = 0; u < 4; ++u) {
        const uint32_t v = v0 + u * T;
        if (v >= n16) break;
        if (MODE == PUB_SENTINEL && !sn::ready16<Fmt>(x[u]) &&
            !sn::wait16<Fmt, S>(w, slot + v, x[u], what_id(SW_SLOT, it))) {
          fail_s = 1;
          return;
        }
        if (d) d[v] = x[u];
        else sink ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
      }
    }
  };
  auto reset_data = [&](uint32_t r, uint32_t from) {
    uint8_t* slot = slot_of(a, from, r);
    for (uint32_t v = tid; v < n16; v += T) sn::reset16<Fmt, S>(slot + static_cast<size_t>(v) * 16);
  };
  // Sentinel slot reuse (mb/sentinel.cuh): 2 copies reset then fence; 3 copies fence then reset.
  auto after_consume = [&](uint32_t r, uint32_t from_lo, uint32_t from_hi, uint32_t skip) {
    if (MODE != PUB_SENTINEL) return;
    if (C == 2)
      for (uint32_t s = from_lo; s < from_hi; ++s)
        if (s != skip) reset_data(r, s);
    __syncthreads();
    if (tid == 0) sn::reuse_fence<S>();
    __syncthreads();
    if (C == 3)
      for (uint32_t s = from_lo; s < from_hi; ++s)
        if (s != skip) reset_data(r, s);
  };
  // publish to one receiver (PING/STREAM)
  auto publish_one = [&](uint32_t it, uint32_t r, uint32_t to) {
    put_data(it, r, to);
    if (MODE != PUB_SENTINEL && !nosync) {
      __syncthreads();
      if (tid == 0) release_flag(r, to);
    }
  };
  auto consume_one = [&](uint32_t it, uint32_t r, uint32_t from) {
    if (MODE != PUB_SENTINEL && !nosync) {
      if (tid == 0) acquire_flag(it, r, from);
      __syncthreads();
      if (fail_s) return;
    }
    get_data(it, r, from);
  };

  if (tid == 0) {
    meta[PBM_GT_START] = mb::globaltimer();
    meta[PBM_CYC_START] = mb::clock64();
  }
  uint64_t c_first = 0, g_first = 0;
  for (uint32_t it = 0; it < W + R; ++it) {
    const uint32_t r = base + it;
    if (it == W && tid == 0) {
      c_first = mb::clock64();
      g_first = mb::globaltimer();
    }
    if (pattern == PAT_ALLTOALL) {
      for (uint32_t b = 0; b < N; ++b)
        if (b != a) put_data(it, r, b);
      if (MODE != PUB_SENTINEL && !nosync) {
        __syncthreads();
        if (tid < N && tid != static_cast<uint32_t>(a)) release_flag(r, tid);
        if (tid < N && tid != static_cast<uint32_t>(a)) acquire_flag(it, r, tid);
        __syncthreads();
      }
      if (!fail_s)
        for (uint32_t s = 0; s < N; ++s)
          if (s != static_cast<uint32_t>(a)) get_data(it, r, s);
      if (!nosync) after_consume(r, 0, N, a);
    } else if (pattern == PAT_PING) {
      const uint32_t other = 1u - a;
      if (a == 0) {
        publish_one(it, r, other);
        consume_one(it, r, other);
        if (!nosync) after_consume(r, other, other + 1, 0xFFFFFFFFu);
      } else {
        consume_one(it, r, other);
        if (!nosync) after_consume(r, other, other + 1, 0xFFFFFFFFu);
        publish_one(it, r, other);
      }
    } else {  // PAT_STREAM
      if (a == 0) {
        if (!nosync && r >= C && tid == 0) {  // copy r % C is free once round r - C was consumed
          if (!poll_geq<S, POLL_ACQ>(w, ack_of(0, 1), r - C + 1, what_id(SW_ACK, it), 0, polls)) fail_s = 1;
        }
        __syncthreads();
        if (!fail_s) publish_one(it, r, 1);
      } else {
        consume_one(it, r, 0);
        if (MODE == PUB_SENTINEL) reset_data(r, 0);
        __syncthreads();
        if (!nosync && tid == 0) mb::st_release<S>(ack_of(0, 1), r + 1);  // releases our loads and resets
      }
    }
    __syncthreads();
    if (tid == 0 && it >= W) rec[it - W] = mb::clock64();
    // Every thread must take the same decision: read, then a barrier before anyone can set
    // fail_s in the next round (a split decision would leave threads at a bar.sync forever).
    const bool failed = fail_s != 0;
    __syncthreads();
    if (failed) break;
  }
  __syncthreads();
  if (tid == 0) {
    uint64_t* out = reinterpret_cast<uint64_t*>(P[PB_OUT]) + static_cast<size_t>(a) * R;
    for (uint32_t j = 0; j < R; ++j) out[j] = fail_s ? 0ull : rec[j];
    meta[PBM_SMID] = mb::smid();
    meta[PBM_STATUS] = fail_s ? PBS_TIMEOUT : PBS_OK;
    meta[PBM_GT_START] = g_first;
    meta[PBM_CYC_START] = c_first;
    meta[PBM_GT_END] = mb::globaltimer();
    meta[PBM_CYC_END] = mb::clock64();
    meta[PBM_SINK] = sink ^ polls;
  }
}

#define MB_PUB_KERNEL(NAME, MODE, FMT, SCOPE)                                                      \
  extern "C" __global__ void __launch_bounds__(PB_THREADS, 1) NAME(const uint64_t* P) {              \
    MB_INJECT_SCOPE(); /* the gate's calibrated slowdown (mb/inject.cuh) */                         \
    publish_kernel<MODE, FMT, SCOPE>(P);                                                            \
  }
MB_PUB_KERNEL(sync_pub_fence_flag_gpu, PUB_FENCE_FLAG, sn::F32, Scope::gpu)
MB_PUB_KERNEL(sync_pub_release_flag_gpu, PUB_RELEASE_FLAG, sn::F32, Scope::gpu)
MB_PUB_KERNEL(sync_pub_sentinel_f32_gpu, PUB_SENTINEL, sn::F32, Scope::gpu)
MB_PUB_KERNEL(sync_pub_sentinel_bf16_gpu, PUB_SENTINEL, sn::BF16, Scope::gpu)
MB_PUB_KERNEL(sync_pub_fence_flag_sys, PUB_FENCE_FLAG, sn::F32, Scope::sys)
MB_PUB_KERNEL(sync_pub_release_flag_sys, PUB_RELEASE_FLAG, sn::F32, Scope::sys)
MB_PUB_KERNEL(sync_pub_sentinel_f32_sys, PUB_SENTINEL, sn::F32, Scope::sys)
MB_PUB_KERNEL(sync_pub_sentinel_bf16_sys, PUB_SENTINEL, sn::BF16, Scope::sys)

extern "C" __global__ void sync_pub_heat(unsigned long long ns, float* sink) {
  const float x = heat_body(ns);
  if (x == 12345.0f) sink[0] = x;
}
