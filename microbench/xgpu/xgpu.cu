// Synchronisation and clocks between GPUs (microbench/xgpu, issue 11). One process per GPU
// (torchrun); every pointer named "peer" is another GPU's memory opened through CUDA IPC, so
// every access that another GPU observes is at sys scope. The flag ping-pong itself is
// microbench/sync/flags.cu's kernel with one role per GPU.
//
// xgpu_allreduce_f32 / xgpu_allgather_bf16: sentinel collectives. Rank r's slots hold
//   [copies][N senders][bytes]; every rank pushes its payload (canonicalised, mb/sentinel.cuh)
//   into slot [round % copies][r] of every rank (itself included), then polls its own memory
//   until all N senders' elements are not the sentinel, then resets the consumed copy; a sys
//   fence makes the copy reusable (every round with 2 or 3 copies, every m rounds with 2m: the
//   slot-reuse comment below). The reduction
//   adds in rank order 0..N-1 on every rank, so all ranks hold the same bits. Block b owns
//   bytes [b*chunk, (b+1)*chunk) of every payload and waits only for its own chunks: blocks
//   never wait for each other. Timer: block 0 thread 0's %clock64 after its share of each
//   round's publication, after its waits and at the round's end; %globaltimer around the
//   recorded rounds (cross-check).
// xgpu_gt_pingpong: %globaltimer offset between two GPUs. The initiator stamps send and
//   receive, the responder its receive; offset = t_resp - (t_send + t_recv) / 2 (symmetric trips
//   assumed; error at most half the round trip). A nanosleep of varying length between rounds
//   spreads the stamps over the timer's tick phases.
// xgpu_host_anchor: %globaltimer against the host's CLOCK_REALTIME: the host writes a sequence
//   number into pinned memory, the device stamps %globaltimer on seeing it and acknowledges.
// xgpu_stops: a persistent grid (one block per SM) on every GPU does the same work between
//   sync stops (a slice of HBM read per block, or a %globaltimer spin); at each stop every
//   block arrives on a local counter, block 0 exchanges stop flags with every GPU, then
//   releases its blocks. Every block stamps %globaltimer on arrival and departure; block 0
//   also when its GPU had arrived and when every GPU had. The host maps the stamps to one
//   time base with the measured offsets.
// Every wait is bounded (mb/spin.cuh) and names what it waited for (XWait).
#include "mb/types.cuh"
#include "mb/ptx.cuh"
#include "mb/spin.cuh"
#include "mb/sentinel.cuh"

using mb::Scope;
namespace sn = mb::sentinel;

// Watchdog what-ids: (kind << 24) | index. microbench/xgpu/runners.py parses this enum.
enum XWait : int {
  XW_SLOT = 1,      // collective: waiting for a sender's chunk; index = sender * 65536 + round
  XW_GT_PING = 2,   // clock ping-pong responder; index = round
  XW_GT_PONG = 3,   // clock ping-pong initiator; index = round
  XW_HOST = 4,      // host anchor: waiting for the host's sequence number; index = round
  XW_ARRIVE = 5,    // stops: block 0 waiting for this GPU's blocks; index = stop
  XW_PEER = 6,      // stops: block 0 waiting for another GPU's stop flag; index = rank * 65536 + stop
  XW_RELEASE = 7,   // stops: a block waiting for block 0's release; index = stop
  XW_WAIT_END = 8
};
__device__ __forceinline__ uint32_t xwhat(uint32_t kind, uint32_t index) { return (kind << 24) | (index & 0xFFFFFFu); }

// Launch shape and flag-line layout; microbench/xgpu/runners.py reads this enum (one source).
enum XShape : int {
  XC_THREADS = 256,    // threads of a collective block and of a stops block
  XS_LINE_WORDS = 32   // u32 words per flag line (128 B: one line per sender, counter, release)
};
constexpr uint32_t VEC = 4;  // vectors a collective thread has in flight per sender

// ------------------------------------------------------------------ sentinel collectives
enum XCParam : int {
  XC_RANK = 0,   // this GPU's rank
  XC_N,          // ranks (2..255: a watchdog id holds the sender in 8 bits)
  XC_SLOTS,      // u64 [N]: rank d's slot base as this GPU addresses it (own rank: local memory)
  XC_BYTES,      // payload bytes per rank (a multiple of 16 * blocks)
  XC_COPIES,     // 2, 3, or 2 x XC_FENCE_EVERY (the slot-reuse order, below)
  XC_FENCE_EVERY,  // the reuse fence every this many rounds (1, or with copies >= 2 x it)
  XC_WARMUP,     // unrecorded rounds
  XC_ROUNDS,     // recorded rounds
  XC_BASE,       // absolute number of the first round (copies alternate across launches)
  XC_SRC,        // u8 [rounds][bytes] this rank's payloads (verify), or 0 (generated payloads)
  XC_DST,        // verify: all-reduce u8 [rounds][bytes], all-gather u8 [rounds][N][bytes]; or 0
  XC_OUT,        // u64 [rounds][3] block 0 thread 0's %clock64 when its share of the round's publication,
                 //   its waits and the whole round (slot reuse included) were done
  XC_META,       // u64 [XM_FIELDS]
  XC_WD,
  XC_BOUND_NS,
  XC_SINK,       // u32: folds received data in timed mode (keeps the loads live)
  XC_NPARAMS
};
enum XCMeta : int { XM_GT_START = 0, XM_GT_END, XM_CYC_START, XM_CYC_END, XM_STATUS, XM_FIELDS };
enum XStatus : int { XS_NOT_RUN = 0, XS_OK = 1, XS_TIMEOUT = 2 };

// Timed-mode payload: cheap, different per round, rank and vector (any bits: put16 encodes).
__device__ __forceinline__ uint4 gen16(uint32_t round, uint32_t rank, uint32_t idx) {
  uint32_t h = round * 0x9E3779B1u ^ (rank + 1u) * 0x85EBCA77u ^ idx * 0xC2B2AE3Du;
  h ^= h >> 15;
  return make_uint4(h, h * 3u + 1u, h ^ 0x5bd1e995u, h + idx);
}

__device__ __forceinline__ uint4 add_f32x4(uint4 a, uint4 b) {
  return make_uint4(__float_as_uint(__uint_as_float(a.x) + __uint_as_float(b.x)),
                    __float_as_uint(__uint_as_float(a.y) + __uint_as_float(b.y)),
                    __float_as_uint(__uint_as_float(a.z) + __uint_as_float(b.z)),
                    __float_as_uint(__uint_as_float(a.w) + __uint_as_float(b.w)));
}

template <class Fmt, bool REDUCE> __device__ __forceinline__ void collective(const uint64_t* P) {
  const mb::Watchdog w{reinterpret_cast<unsigned long long*>(P[XC_WD]), P[XC_BOUND_NS]};
  const uint32_t rank = static_cast<uint32_t>(P[XC_RANK]), n = static_cast<uint32_t>(P[XC_N]);
  const uint64_t* slots = reinterpret_cast<const uint64_t*>(P[XC_SLOTS]);
  // 32-bit offsets inside the slots (the host keeps copies x N x bytes under 4 GB): 64-bit
  // divisions are calls on the GPU and their register traffic spilled in the round loop.
  const uint32_t bytes = static_cast<uint32_t>(P[XC_BYTES]);
  const uint32_t copies = static_cast<uint32_t>(P[XC_COPIES]), every = static_cast<uint32_t>(P[XC_FENCE_EVERY]);
  const uint32_t warm = static_cast<uint32_t>(P[XC_WARMUP]), rounds = static_cast<uint32_t>(P[XC_ROUNDS]);
  const uint64_t base = P[XC_BASE];
  const uint8_t* src = reinterpret_cast<const uint8_t*>(P[XC_SRC]);
  uint8_t* dst = reinterpret_cast<uint8_t*>(P[XC_DST]);
  uint64_t* meta = reinterpret_cast<uint64_t*>(P[XC_META]);
  const uint32_t chunk = bytes / gridDim.x, off0 = chunk * blockIdx.x, copy_bytes = bytes * n;
  const uint32_t n16 = chunk / 16, tid = threadIdx.x;
  uint8_t* mine = reinterpret_cast<uint8_t*>(slots[rank]);
  __shared__ int failed_s;
  if (tid == 0) failed_s = 0;
  __syncthreads();
  uint32_t sink = 0;
  bool ok = true;
  uint64_t gt0 = mb::globaltimer(), c0 = mb::clock64();
  for (uint32_t it = 0; it < warm + rounds; ++it) {
    const uint64_t r = base + it;
    const int32_t j = static_cast<int32_t>(it) - static_cast<int32_t>(warm);
    const uint32_t copy = (static_cast<uint32_t>(r) % copies) * copy_bytes;
    if (j == 0 && tid == 0 && blockIdx.x == 0) {
      gt0 = mb::globaltimer();
      c0 = mb::clock64();
    }
    // publish: this rank's chunk into slot [copy][rank] of every rank (itself included)
    for (uint32_t i = tid; i < n16; i += XC_THREADS) {
      const uint32_t o = off0 + 16u * i;
      const uint4 raw = src ? *reinterpret_cast<const uint4*>(src + static_cast<uint64_t>(j < 0 ? 0 : j) * bytes + o)
                            : gen16(static_cast<uint32_t>(r), rank, o / 16);
      for (uint32_t d = 0; d < n; ++d)
        sn::put16<Fmt, Scope::sys>(reinterpret_cast<uint8_t*>(slots[d]) + copy + rank * bytes + o, raw);
    }
    // recomputed at each use, not held: a pointer live across the waits' out-of-line watchdog call
    // is spilled (108 B of spills when it was a variable)
    auto mark = [&](uint32_t k) {
      if (tid == 0 && blockIdx.x == 0 && j >= 0)
        reinterpret_cast<uint64_t*>(P[XC_OUT])[3u * static_cast<uint32_t>(j) + k] = mb::clock64();
    };
    mark(0);
    // consume every sender's chunk from local memory, in rank order. A thread's vectors go in
    // groups of VEC: one sender's VEC loads are issued together and only the vectors still empty
    // are re-polled (one vector at a time cost a local round trip per extra vector: +1.2 us a
    // round at 2 vectors a thread, 2026-11-30 shakedown).
    for (uint32_t i0 = tid; i0 < n16 && ok; i0 += VEC * XC_THREADS) {
      uint4 acc[VEC];
      for (uint32_t s = 0; s < n && ok; ++s) {
        const uint8_t* base = mine + copy + s * bytes + off0;
        uint4 v[VEC];
#pragma unroll
        for (uint32_t u = 0; u < VEC; ++u)
          if (i0 + u * XC_THREADS < n16) v[u] = mb::ld_relaxed_v4<Scope::sys>(base + 16u * (i0 + u * XC_THREADS));
#pragma unroll
        for (uint32_t u = 0; u < VEC; ++u) {
          const uint32_t i = i0 + u * XC_THREADS;
          if (i >= n16 || !ok) break;
          if (!sn::ready16<Fmt>(v[u]) &&
              !sn::wait16<Fmt, Scope::sys>(w, base + 16u * i, v[u],
                                           xwhat(XW_SLOT, s * 65536u + (static_cast<uint32_t>(r) & 0xFFFFu)))) {
            ok = false;
            break;
          }
          if constexpr (REDUCE) {
            acc[u] = s == 0 ? v[u] : add_f32x4(acc[u], v[u]);  // fixed order: the same bits on every rank
          } else if (dst && j >= 0) {
            *reinterpret_cast<uint4*>(dst + (static_cast<uint64_t>(j) * n + s) * bytes + off0 + 16u * i) = v[u];
          } else {
            sink ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
          }
        }
      }
      if constexpr (REDUCE) {
#pragma unroll
        for (uint32_t u = 0; u < VEC; ++u) {
          const uint32_t i = i0 + u * XC_THREADS;
          if (!ok || i >= n16) break;
          if (dst && j >= 0) *reinterpret_cast<uint4*>(dst + static_cast<uint64_t>(j) * bytes + off0 + 16u * i) = acc[u];
          else sink ^= acc[u].x ^ acc[u].y ^ acc[u].z ^ acc[u].w;
        }
      }
    }
    if (!ok) failed_s = 1;
    mark(1);
    // Slot reuse (mb/sentinel.cuh). Each thread resets the vectors it consumed itself. A reset of
    // copy c in round r must be visible before a sender writes c again in round r + copies; the
    // sender does so after seeing this rank's later publication and fencing (acquire) itself.
    //   fence every m rounds (after the resets; m = XC_FENCE_EVERY, copies >= 2m): a reset of
    //     round r is released by a fence within m - 1 rounds, the sender acquires the publication
    //     after it with its own fence within m more rounds, which precedes its write of round
    //     r + 2m <= r + copies. m = 1, 2 copies: the double-buffered rule, a fence a round.
    //   3 copies, m = 1: the fence before the resets (it releases the round before's, which had a
    //     round to drain), mb/sentinel.cuh's triple-buffered rule.
    if (copies == 3) {
      __syncthreads();
      if (tid == 0) sn::reuse_fence<Scope::sys>();
      __syncthreads();
    }
    for (uint32_t i = tid; i < n16; i += XC_THREADS)
      for (uint32_t s = 0; s < n; ++s) sn::reset16<Fmt, Scope::sys>(mine + copy + s * bytes + off0 + 16u * i);
    if (copies != 3) {
      __syncthreads();
      if (tid == 0 && (static_cast<uint32_t>(r) + 1u) % every == 0) sn::reuse_fence<Scope::sys>();  // r: across launches
    }
    __syncthreads();
    if (failed_s) break;  // block-uniform: every thread read it after the same barrier
    mark(2);
  }
  if (tid == 0 && blockIdx.x == 0) {
    meta[XM_CYC_END] = mb::clock64();
    meta[XM_GT_END] = mb::globaltimer();
    meta[XM_GT_START] = gt0;
    meta[XM_CYC_START] = c0;
  }
  if (tid == 0) {
    if (failed_s) meta[XM_STATUS] = XS_TIMEOUT;  // any block's failure wins
    else atomicCAS(reinterpret_cast<unsigned long long*>(&meta[XM_STATUS]), XS_NOT_RUN, XS_OK);
  }
  if (sink == 0x12345679u) reinterpret_cast<uint32_t*>(P[XC_SINK])[0] = sink;
}

extern "C" __global__ void __launch_bounds__(XC_THREADS, 1) xgpu_allreduce_f32(const uint64_t* P) {
  collective<sn::F32, true>(P);
}
extern "C" __global__ void __launch_bounds__(XC_THREADS, 1) xgpu_allgather_bf16(const uint64_t* P) {
  collective<sn::BF16, false>(P);
}

// ------------------------------------------------------------------ %globaltimer offset
enum XTParam : int {
  XT_ROLE = 0,   // 0 initiator, 1 responder
  XT_PING,       // u32* written by the initiator, polled by the responder (responder's memory)
  XT_PONG,       // u32* written by the responder, polled by the initiator (initiator's memory)
  XT_ROUNDS,
  XT_BASE,       // flags are monotonic across launches: round i writes base + i + 1
  XT_GAP_NS,     // largest nanosleep between rounds (varied per round)
  XT_OUT,        // u64 [rounds][2]: initiator (send, receive), responder (receive, receive)
  XT_META,       // u64 [XM_FIELDS]
  XT_WD,
  XT_BOUND_NS,
  XT_NPARAMS
};

extern "C" __global__ void xgpu_gt_pingpong(const uint64_t* P) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const mb::Watchdog w{reinterpret_cast<unsigned long long*>(P[XT_WD]), P[XT_BOUND_NS]};
  const uint32_t role = static_cast<uint32_t>(P[XT_ROLE]), rounds = static_cast<uint32_t>(P[XT_ROUNDS]);
  const uint32_t base = static_cast<uint32_t>(P[XT_BASE]), gap = static_cast<uint32_t>(P[XT_GAP_NS]);
  uint32_t* ping = reinterpret_cast<uint32_t*>(P[XT_PING]);
  uint32_t* pong = reinterpret_cast<uint32_t*>(P[XT_PONG]);
  uint64_t* out = reinterpret_cast<uint64_t*>(P[XT_OUT]);
  uint64_t* meta = reinterpret_cast<uint64_t*>(P[XT_META]);
  meta[XM_GT_START] = mb::globaltimer();
  bool ok = true;
  for (uint32_t i = 0; i < rounds && ok; ++i) {
    const uint32_t v = base + i + 1;
    if (role == 0) {
      if (gap) mb::nanosleep((i * 97u) % (gap + 1u));  // vary the phase against the timer's tick
      const uint64_t t0 = mb::globaltimer();
      mb::st_release_sys(ping, v);
      ok = mb::spin_geq_sys(w, pong, v, xwhat(XW_GT_PONG, i));
      const uint64_t t1 = mb::globaltimer();
      out[2 * i] = t0;
      out[2 * i + 1] = t1;
    } else {
      ok = mb::spin_geq_sys(w, ping, v, xwhat(XW_GT_PING, i));
      const uint64_t t = mb::globaltimer();
      mb::st_release_sys(pong, v);
      out[2 * i] = t;
      out[2 * i + 1] = t;
    }
  }
  meta[XM_GT_END] = mb::globaltimer();
  meta[XM_STATUS] = ok ? XS_OK : XS_TIMEOUT;
}

// ------------------------------------------------------------------ host anchor
enum XHParam : int {
  XH_SEQ = 0,    // u32* pinned host memory: the host writes 1, 2, ...
  XH_ACK,        // u32* pinned host memory: the device echoes each number after stamping it
  XH_ROUNDS,
  XH_OUT,        // u64 [rounds] %globaltimer when number k + 1 was seen
  XH_META,       // u64 [XM_FIELDS]
  XH_WD,
  XH_BOUND_NS,
  XH_NPARAMS
};

extern "C" __global__ void xgpu_host_anchor(const uint64_t* P) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const mb::Watchdog w{reinterpret_cast<unsigned long long*>(P[XH_WD]), P[XH_BOUND_NS]};
  uint32_t* seq = reinterpret_cast<uint32_t*>(P[XH_SEQ]);
  uint32_t* ack = reinterpret_cast<uint32_t*>(P[XH_ACK]);
  uint64_t* out = reinterpret_cast<uint64_t*>(P[XH_OUT]);
  uint64_t* meta = reinterpret_cast<uint64_t*>(P[XH_META]);
  const uint32_t rounds = static_cast<uint32_t>(P[XH_ROUNDS]);
  bool ok = true;
  for (uint32_t k = 0; k < rounds && ok; ++k) {
    ok = mb::spin_geq_sys(w, seq, k + 1, xwhat(XW_HOST, k));
    out[k] = mb::globaltimer();
    mb::st_release_sys(ack, k + 1);
  }
  meta[XM_STATUS] = ok ? XS_OK : XS_TIMEOUT;
}

// ------------------------------------------------------------------ common sync stops
enum XSParam : int {
  XS_RANK = 0,
  XS_N,
  XS_STOPS,       // stops in this launch
  XS_BASE,        // stops before this launch (counters and flags are monotonic)
  XS_FLAGS,       // u64 [N]: rank d's flag lines (128 B apart) as this GPU addresses them;
                  //   line s of rank d holds sender s's stop count, line N its arrive counter,
                  //   line N + 1 its release word
  XS_WORK_SRC,    // u8* HBM buffer read between stops (0: spin XS_WORK_NS instead)
  XS_WORK_SRC_BYTES,
  XS_WORK_BYTES,  // bytes each block reads between stops (a multiple of 16 * XC_THREADS)
  XS_WORK_NS,     // %globaltimer spin between stops when XS_WORK_SRC is 0
  XS_ARRIVE,      // u64 [stops][blocks] %globaltimer on arrival
  XS_DEPART,      // u64 [stops][blocks] %globaltimer on departure
  XS_GPU,         // u64 [stops][2] block 0: when this GPU's blocks had all arrived, when every GPU had
  XS_META,        // u64 [XM_FIELDS]
  XS_WD,
  XS_BOUND_NS,
  XS_SINK,
  XS_NPARAMS
};

extern "C" __global__ void __launch_bounds__(XC_THREADS, 1) xgpu_stops(const uint64_t* P) {
  const mb::Watchdog w{reinterpret_cast<unsigned long long*>(P[XS_WD]), P[XS_BOUND_NS]};
  const uint32_t rank = static_cast<uint32_t>(P[XS_RANK]), n = static_cast<uint32_t>(P[XS_N]);
  const uint32_t stops = static_cast<uint32_t>(P[XS_STOPS]), base = static_cast<uint32_t>(P[XS_BASE]);
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(P[XS_FLAGS]);
  uint32_t* mine = reinterpret_cast<uint32_t*>(flags[rank]);
  uint32_t* arrive_ctr = mine + XS_LINE_WORDS * n;
  uint32_t* release = mine + XS_LINE_WORDS * (n + 1u);
  const uint4* wsrc = reinterpret_cast<const uint4*>(P[XS_WORK_SRC]);
  const uint64_t wsrc16 = P[XS_WORK_SRC_BYTES] / 16, wn16 = P[XS_WORK_BYTES] / 16;
  const uint64_t work_ns = P[XS_WORK_NS];
  uint64_t* arr = reinterpret_cast<uint64_t*>(P[XS_ARRIVE]);
  uint64_t* dep = reinterpret_cast<uint64_t*>(P[XS_DEPART]);
  uint64_t* gpu = reinterpret_cast<uint64_t*>(P[XS_GPU]);
  uint64_t* meta = reinterpret_cast<uint64_t*>(P[XS_META]);
  __shared__ int failed_s;
  if (threadIdx.x == 0) failed_s = 0;
  __syncthreads();
  uint32_t sink = 0;
  for (uint32_t s = 0; s < stops; ++s) {
    const uint32_t t = base + s + 1;
    // the same work on every block of every GPU
    if (wsrc) {
      const uint64_t start = ((static_cast<uint64_t>(base + s) * gridDim.x + blockIdx.x) * wn16) % (wsrc16 ? wsrc16 : 1);
      for (uint64_t i = threadIdx.x; i < wn16; i += XC_THREADS) {
        const uint4 v = mb::ld_nc_v4(wsrc + (start + i) % wsrc16);
        sink ^= v.x ^ v.y ^ v.z ^ v.w;
      }
    } else if (threadIdx.x == 0) {
      const uint64_t t0 = mb::globaltimer();
      while (mb::globaltimer() - t0 < work_ns) {}
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const size_t at = static_cast<size_t>(s) * gridDim.x + blockIdx.x;
      arr[at] = mb::globaltimer();
      mb::atom_add_release_gpu(arrive_ctr, 1u);
      bool ok = true;
      if (blockIdx.x == 0) {
        ok = mb::spin_geq(w, arrive_ctr, t * gridDim.x, xwhat(XW_ARRIVE, s));
        const uint64_t here = mb::globaltimer();
        if (ok) for (uint32_t d = 0; d < n; ++d) mb::st_release_sys(reinterpret_cast<uint32_t*>(flags[d]) + XS_LINE_WORDS * rank, t);
        for (uint32_t d = 0; d < n && ok; ++d) ok = mb::spin_geq_sys(w, mine + XS_LINE_WORDS * d, t, xwhat(XW_PEER, d * 65536u + s));
        gpu[2 * s] = here;
        gpu[2 * s + 1] = mb::globaltimer();
        if (ok) mb::st_release_gpu(release, t);
      } else {
        ok = mb::spin_geq(w, release, t, xwhat(XW_RELEASE, s));
      }
      dep[at] = mb::globaltimer();
      if (!ok) failed_s = 1;
    }
    __syncthreads();
    if (failed_s) break;
  }
  if (threadIdx.x == 0) {
    if (failed_s) meta[XM_STATUS] = XS_TIMEOUT;
    else atomicCAS(reinterpret_cast<unsigned long long*>(&meta[XM_STATUS]), XS_NOT_RUN, XS_OK);
  }
  if (sink == 0x12345679u) reinterpret_cast<uint32_t*>(P[XS_SINK])[0] = sink;
}
