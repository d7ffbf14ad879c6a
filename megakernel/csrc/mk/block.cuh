// Per-block state: the shared-memory carve-up and the weight ring.
//
// Shared memory (SMEM_BYTES, rendered by plan.py):
//   abuf   ABUF_BYTES  activation operand (16 token rows x K bf16, padded) or attention tiles
//   ring   RING_STAGES x STAGE_BYTES  weight chunks, filled by the loader warp's bulk copies
//   red    RED_BYTES   per-warp partial sums of a bf16 GEMM tile, reduced in fixed warp order,
//          or an fp4 GEMM unit's results (gemm.cuh gemm_fp4)
//   keep   KEEP_BYTES  Plan.fused_experts: gate/up units' activations kept for the down projection
//   bars   2 x RING_STAGES mbarriers (full: one arrival + tx bytes; empty: one arrival per
//          compute thread), xbar (the normed operand's copies), then small ints (staged-activation
//          tag, top-k scratch, norm factors)
// Ring protocol: chunk c lives in stage c % RING_STAGES; the producer waits for `empty` of
// use (c / RING_STAGES) - 1, announces the bytes on `full` and issues the copies; consumers
// wait for `full` of use c / RING_STAGES, read, and each compute thread arrives on `empty`. Producer and
// consumers walk the same chunk sequence (program.cuh), so c agrees on both sides.
#pragma once
#include "mb/profile.cuh"
#include "mk/layers.cuh"
#include "mk/wait.cuh"

namespace mk {

constexpr int MISC_TAG = 0;      // which activation operand abuf holds (-1: none)
constexpr int MISC_OPS_DONE = 1;  // ops of this launch the compute warps have finished
// [2] the routed ops' slot count, what their routing wait read (program.cuh routed_slot). Two
// copies: a block with no unit of a routed op passes no barrier between its readers and the next
// routed op's writer, so the next writer takes the other copy; the barrier of the routed op in
// between (every compute thread runs it) orders a copy's readers before its next write
constexpr int MISC_ROUTED = 2;
constexpr int MISC_ROWS = 4;     // [16] gathered row indices of an expert operand
constexpr int MISC_DEPS = 20;    // [4] thread 0's DepCache of the current op (program.cuh)
constexpr int MISC_PEND = 24;    // [4] thread 0's Pending signals of the current op
constexpr int MISC_SLOT = 28;    // [3] the current expert slot's expert, token count and operand tag (slot.cuh)
constexpr int MISC_NSLOTS = 31;  // top-k's slot count, from its unit to its signal (program.cuh signal_op_end)
constexpr int MISC_OP = 32;      // [16] thread 0's copy of the current op record (program.cuh)
constexpr int MISC_PROF = 48;     // [10] the profiler's state (megakernel.cu; 8-byte aligned)
static_assert(MISC_SCRATCH == MISC_PROF + 10, "top-k scratch (rendered from plan.py) starts past the profiler's state");
// top-k scratch: selections [T_MAX*TOPK], slot prefix [E/32], expert bitmap [E/32], token masks [E]
constexpr int MISC_RTAG = MISC_SCRATCH + T_MAX * TOPK + 2 * ((E + 31) / 32) + E;  // tag of the norm's factors
constexpr int MISC_RNORM = MISC_RTAG + 1;  // [16] float: the staged norm's rsqrt(mean(x^2) + eps) per token row
// the profiler's deferred op stamps (program.cuh ProfSlot): PROF_OPS (rendered) slots of 8 ints, 8-byte aligned
constexpr int MISC_PSLOT = (MISC_RNORM + 16 + 1) & ~1;
constexpr int MISC_PWIN = MISC_PSLOT + 8 * PROF_OPS;  // the first op of the slots' current window
// [2] an op's own "wait end" instant, where its wait is inside the op (top-k's sentinel poll)
constexpr int MISC_PWAIT = MISC_PWIN + 2;
// [KEEP_MAX] fused: the unit tag whose activations each kept-unit buffer holds (-1: none; ops/expert_gemm1.cuh)
constexpr int MISC_KEEP = MISC_PWAIT + 2;
// The step's shape, written by the compute warps after pdl_wait() (load_step); the loader warp
// never reads it. [STEP_INTS] the step block (abi.py STEP_FIELDS), [T_MAX / 4] each row's request
// (a byte each), [B_MAX] each request's attention splits in a global layer (low 16 bits) and a
// sliding one (high), [2] their sums. Packed: every byte of misc can decide whether a ring stage
// fits (Plan.misc_bytes)
// Row groups (GROUPS > 1): one such area per group, STEP_AREA ints apart, the current group's at
// Blk.gofs past these offsets; then [2 x GROUPS] the routed slot counts (MISC_ROUTED's) per group.
constexpr int MISC_STEP = MISC_KEEP + KEEP_MAX;
constexpr int MISC_ROW_REQ = MISC_STEP + STEP_INTS;
constexpr int MISC_SPLITS = MISC_ROW_REQ + (T_MAX + 3) / 4;
constexpr int MISC_SPAN = MISC_SPLITS + B_MAX;
constexpr int STEP_AREA = MISC_SPAN + 2 - MISC_STEP;
constexpr int MISC_GROUTED = MISC_STEP + GROUPS * STEP_AREA;
constexpr int MISC_INTS = MISC_GROUTED + (GROUPS > 1 ? 2 * GROUPS : 0);
static_assert(GROUPS >= 1 && (GROUPS == 1 || RANKS_PER_LAUNCH == 1), "row groups run on one rank");
static_assert(MAX_SPLITS < (1 << 16), "a request's splits fit 16 bits");
static_assert(KEEP_UNITS <= KEEP_MAX && KEEP_BYTES % 16 == 0, "kept units: their tags fit MISC_KEEP; aligned buffers");

struct Blk {
  const Params* p;  // the current op's group's (row groups), else the block's rank's
  const Params* p0;  // row groups: group 0's; group g's is p0 + g
  unsigned char* abuf;
  unsigned char* ring;
  float* red;
  unsigned char* keep;  // fused: KEEP_UNITS gate/up units' activations in the down projection's layout
  uint64_t* full;
  uint64_t* empty;
  uint64_t* xbar;  // the normed operand's bulk copies (gemm.cuh stage_normed): one arrival + tx bytes
  int* misc;
  // the step's token rows and requests: valid in the compute warps from load_step on (after
  // pdl_wait: a device loop's previous launch may write the step block). Never read by the
  // loader warp, which runs before pdl_wait; the emulation poisons them there (step_rows)
  int rows_, nreq_;
  int gofs;  // row groups: the current group's step area in misc, past MISC_STEP (0 without groups)
  int group;  // row groups: the current group (-1 before the first op)
  int parity, wait;
  unsigned chunk;  // consumer's position in the chunk sequence
  unsigned xuse;   // compute threads: phases of xbar waited for
  bool failed;     // one of this thread's bounded waits gave up (stop at the next unit boundary)
  unsigned pace;   // loader: the chunk it lets land before it copies more (~0u: none; loader_loop)
};

constexpr int STEP_UNREAD = -(1 << 30);  // Blk.rows_ / nreq_ before load_step

MK_DEV Blk make_blk(const Params* p, int parity, int wait) {
  Blk b;
  unsigned char* s = smem();
  b.p = p;
  b.p0 = p;
  b.abuf = s;
  b.ring = s + ABUF_BYTES;
  b.red = reinterpret_cast<float*>(b.ring + RING_STAGES * STAGE_BYTES);
  b.keep = reinterpret_cast<unsigned char*>(b.red) + RED_BYTES;
  b.full = reinterpret_cast<uint64_t*>(b.keep + KEEP_BYTES);
  b.empty = b.full + RING_STAGES;
  b.xbar = b.empty + RING_STAGES;
  b.misc = reinterpret_cast<int*>(b.xbar + 1);
  b.rows_ = b.nreq_ = STEP_UNREAD;
  b.gofs = 0;
  b.group = -1;
  b.parity = parity;
  b.wait = wait;
  b.chunk = 0;
  b.xuse = 0;
  b.failed = false;
  b.pace = ~0u;
  return b;
}
static_assert(((2 * RING_STAGES + 1) * 8 + MISC_INTS * 4 + 15) / 16 * 16 == MISC_BYTES,
              "mbarriers + misc are the tail of SMEM_BYTES that Plan.misc_bytes sized");
static_assert(sizeof(mb::prof::Profiler) <= 4 * (MISC_SCRATCH - MISC_PROF) && MISC_PROF % 2 == 0,
              "the profiler fits MISC_PROF, 8-byte aligned");

// The step's shape (abi.py STEP_FIELDS). The emulation refuses a read before load_step (the
// loader warp's, or a compute warp's before pdl_wait): on the GPU it would race a device loop's
// update of the step block.
MK_DEV int step_checked(int v) {
#ifdef MK_HOST_EMU
  if (v == STEP_UNREAD) emu::fail("the step's shape read before load_step (by the loader warp, or before pdl_wait)");
#endif
  return v;
}
MK_DEV int step_rows(const Blk& b) { return step_checked(b.rows_); }  // token rows of the step, all requests
MK_DEV int step_nreq(const Blk& b) { return step_checked(b.nreq_); }  // requests
// the current group's step area (a constant 0 in a build without row groups: the same code)
MK_DEV int gofs(const Blk& b) {
  if constexpr (GROUPS > 1) return b.gofs;
  return 0;
}
MK_DEV int req_ctx(const Blk& b, int r) { return b.misc[gofs(b) + MISC_STEP + STEP_CTX + r]; }    // r's cached positions
MK_DEV int req_row0(const Blk& b, int r) { return b.misc[gofs(b) + MISC_STEP + STEP_ROW0 + r]; }  // r's first row
MK_DEV int req_rows(const Blk& b, int r) { return req_row0(b, r + 1) - req_row0(b, r); }
MK_DEV int row_req(const Blk& b, int t) {  // row t's request
  return reinterpret_cast<const unsigned char*>(b.misc + gofs(b) + MISC_ROW_REQ)[t];
}
// request r's attention splits in `layer` (program.py splits of its own ctx and rows), and the
// sum over the requests: the attention units of one kv head (program.py attn_span)
MK_DEV int req_splits(const Blk& b, int layer, int r) {
  return (static_cast<unsigned>(b.misc[gofs(b) + MISC_SPLITS + r]) >> (is_global(layer) ? 0 : 16)) & 0xffffu;
}
MK_DEV int attn_span(const Blk& b, int layer) { return b.misc[gofs(b) + MISC_SPAN + (is_global(layer) ? 0 : 1)]; }

// Every compute thread, once per launch after pdl_wait(): the step block and the rows' requests
// into shared memory, and warp 0's lanes r < B_MAX each request's splits and (a butterfly) their
// sums; one L2 round trip a launch, then a barrier. Units read all of it from shared memory.
// Invariant (nothing here bounds it): 1 <= n_req <= B_MAX, 1 <= rows <= T_MAX, row0 increasing with
// row0[n_req] = rows, row_req[t] the request whose rows hold t. The host checks every step it
// writes (runtime.Engine); a device op that writes the step block must keep it, or units index
// past the step's buffers.
// Row groups: every group's step block into its own area (one barrier for all of them); the
// group an op runs is entered per op (enter_group).
MK_DEV void load_step(Blk& b) {
  static_assert(STEP_INTS + T_MAX + 32 <= COMPUTE_THREADS, "one word per compute thread past warp 0");
  static_assert(T_MAX <= B_MAX && B_MAX <= 32, "a request has at least one row; a lane per request");
  for (int g = 0; g < GROUPS; ++g) {
    const Params& p = GROUPS > 1 ? b.p0[g] : *b.p;
    int* area = b.misc + g * STEP_AREA;  // MISC_* below are group 0's offsets
    if (warp() == 0) {  // (words past n_req are read and unused)
      const int r = lane() < B_MAX ? lane() : 0;
      const int nreq = ldg_cgi(p.step + STEP_N_REQ), ctx = ldg_cgi(p.step + STEP_CTX + r);
      const int n = ldg_cgi(p.step + STEP_ROW0 + r + 1) - ldg_cgi(p.step + STEP_ROW0 + r);
      const bool mine = lane() < B_MAX && lane() < nreq;
      int sg = mine ? attn_splits_of(true, ctx, n) : 0, ss = mine ? attn_splits_of(false, ctx, n) : 0;
      if (lane() < B_MAX) area[MISC_SPLITS + r] = sg | (ss << 16);
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) {
        sg += shfl_xor_i(sg, m);
        ss += shfl_xor_i(ss, m);
      }
      if (lane() == 0) {
        area[MISC_SPAN] = sg;
        area[MISC_SPAN + 1] = ss;
      }
    } else if (tid() < 32 + STEP_INTS) {
      area[MISC_STEP + tid() - 32] = ldg_cgi(p.step + tid() - 32);
    } else if (tid() < 32 + STEP_INTS + T_MAX) {
      const int t = tid() - 32 - STEP_INTS;
      reinterpret_cast<unsigned char*>(area + MISC_ROW_REQ)[t] = static_cast<unsigned char>(ldg_cgi(p.row_req + t));
    }
  }
  sync_compute();
  b.rows_ = b.misc[MISC_STEP + STEP_ROWS];
  b.nreq_ = b.misc[MISC_STEP + STEP_N_REQ];
}

// Row groups: thread-local, every compute thread and the loader warp at each op: the op's group's
// parameter block and (compute warps) step area. On a change of group, thread 0 also forgets
// every operand this block staged or kept (abuf's, the norm factors, the slot record, kept
// gate/up units): their tags name a layer and a slot, not a group, so a unit of another group
// would take them for its own. Danger: the forgetting is ordered before their next reader only by
// the barrier that opens the op's first unit (or its routing wait's); program.grouped keeps a
// fused gate/up and its down projection adjacent, so kept units still serve their own group.
MK_DEV void enter_group(Blk& b, int g, bool compute) {
  if constexpr (GROUPS > 1) {
    b.p = b.p0 + g;
    if (!compute) return;
    if (g != b.group && tid() == 0) {
      b.misc[MISC_TAG] = -1;
      b.misc[MISC_RTAG] = -1;
      b.misc[MISC_SLOT + 2] = -1;
      for (int k = 0; k < KEEP_UNITS; ++k) b.misc[MISC_KEEP + k] = -1;
    }
    b.group = g;
    b.gofs = g * STEP_AREA;
    b.rows_ = b.misc[b.gofs + MISC_STEP + STEP_ROWS];
    b.nreq_ = b.misc[b.gofs + MISC_STEP + STEP_N_REQ];
  }
}

MK_DEV unsigned char* stage_of(const Blk& b, unsigned c) { return b.ring + (c % RING_STAGES) * STAGE_BYTES; }

// The profiler's stamps inside units (Plan.profile_detail: staging, ring waits), thread 0 only;
// nothing at all in other builds. The profiler lives in shared memory (megakernel.cu).
MK_DEV void detail_stamp(const Blk& b, uint32_t event, uint32_t arg) {
  if constexpr (PROFILE_DETAIL) {
    if (tid() == 0) reinterpret_cast<mb::prof::Profiler*>(b.misc + MISC_PROF)->stamp(event, arg);
  }
}

// ---------------------------------------------------------------- consumer side
MK_DEV const unsigned char* ring_consume(Blk& b, uint32_t what) {
  const unsigned c = b.chunk;
  detail_stamp(b, MK_EV_RING_WAIT_BEGIN, c);
  if (!wait_mbar(*b.p, &b.full[c % RING_STAGES], (c / RING_STAGES) & 1u, what)) b.failed = true;
  detail_stamp(b, MK_EV_RING_WAIT_END, c);
  return stage_of(b, c);
}
// Every thread arrives: an mbarrier arrive releases only the arriving thread's own reads (PTX
// memory model), and the next bulk copy into this stage must not overtake any of them.
MK_DEV void ring_release(Blk& b) {
  mbar_arrive(&b.empty[b.chunk % RING_STAGES]);
  ++b.chunk;
}

// ---------------------------------------------------------------- producer side (loader warp)
// All 32 lanes call, and every lane waits for the stage to be free: each lane that issues a copy
// into it must itself acquire the consumers' release (racecheck reports copies ordered only
// through another lane's wait, shfl and __syncwarp as races; microbench/sanitize/ring_probe.cu).
// Lane 0 then announces `tx` bytes on the stage's `full`. Returns false (for every lane) when a
// wait gave up.
// TP: the compute warps this wait waits for may be in a bounded wait for another rank's data
// (mk/tp.cuh), which began after this one; twice the bound lets that wait, the cause, be the one
// the watchdog record names (the first to give up is recorded).
constexpr uint64_t LOADER_EMPTY_BOUND_NS = TP > 0 ? 2 * SPIN_BOUND_NS : SPIN_BOUND_NS;
MK_DEV bool ring_produce_begin(const Blk& b, unsigned c, unsigned tx, uint32_t what) {
  const bool ok = warp_all(wait_mbar(*b.p, &b.empty[c % RING_STAGES], ((c / RING_STAGES) & 1u) ^ 1u, what,
                                     LOADER_EMPTY_BOUND_NS));
  if (ok && lane() == 0) mbar_expect_tx(&b.full[c % RING_STAGES], tx);
  syncwarp();
  // the consumers' reads of this stage (generic proxy, acquired through `empty`) before the bulk
  // copies that overwrite it (async proxy): the PTX memory model wants a proxy fence between them
  fence_proxy_async_smem();
  return ok;
}

}  // namespace mk
