// Tensor parallelism's collectives (Plan.tp_ranks = TP ranks): sentinel slots every rank can
// address, push model. Each rank owns one block of receive slots (Params.recv; Plan.recv_layout):
//   ar   [2][TP_GROUPS][T_MAX][D] fp32  the attention all-reduce: oproj's K-group partials
//   act  [2][MAX_SLOTS][16][F]     bf16  the gate/up activations' all-gather
//   y    [2][MAX_SLOTS][16][P]     bf16  the expert outputs' all-gather
// A producer stores its values into the slots of every rank (Params.peers, its own included); a
// reader polls only its own copy, bounded, until no element it needs is the sentinel (fp32 -0.0,
// bf16 0xFFFF: mb/sentinel.cuh; writers store +0.0 for -0.0 and 0x7FC0 for 0xFFFF, in every TP
// build, R = 1 included, so that every R computes the same bits), uses the values it polled, and
// resets what it read to the sentinel.
//
// Double buffering: layer l uses copy recv_copy(l); the copy a reader resets is written next two
// layers later. What orders a reset before that next push, in each mode:
//   - the same launch or stream (emulation, one GPU, chain mode anywhere): the reset is in an op
//     of layer l on this rank, and every rank's push of layer l + 2 depends on it through the
//     layer's chain: that rank's all-reduce of l + 1 needs this rank's partials of l + 1, which
//     this rank pushes only after its ops of layer l (its counters, or stream order);
//   - across GPUs (one process per GPU): the same chain, carried between GPUs by the sentinel data
//     itself, with the pattern mb/sentinel.cuh gives for two copies: consume -> reset -> fence ->
//     publish the next round. Every reader unit ends with reuse_fence() (thread 0, after the
//     barrier behind its resets): the release of its resets and, on the other side of the next
//     exchange, the acquire of the data that tells the producer our round is done.
// Danger: a reset overtaken by the next push erases fresh data, and its reader then polls a
// sentinel that never changes: the bounded wait gives up and its record names the rank, the op
// and the slot it waited for (what_x; runtime describe_wait). A reset never done leaves stale data
// that a reader two layers later takes for fresh (tests: every slot is empty after a step).
#pragma once
#include "mb/sentinel_rules.cuh"
#include "mk/block.cuh"
#include "mk/wait.cuh"

namespace mk {

// One process per GPU: the ranks are other GPUs (.sys scope); ranks of one launch share a GPU
// (.gpu). The emulation is sequentially consistent either way.
constexpr bool TP_SYS = RANKS_PER_LAUNCH == 1;
MK_DEV uint32_t tp_load(const void* a) { return TP_SYS ? ld_relaxed_sys(a) : ld_relaxed(a); }
MK_DEV void tp_store(void* a, uint32_t v) {
  if constexpr (TP_SYS) st_relaxed_sys(a, v);
  else st_relaxed(a, v);
}
// After a reader's resets (thread 0, behind a barrier over the resetting threads): mb/sentinel.cuh
// reuse_fence for two copies
MK_DEV void reuse_fence() {
  if constexpr (TP_SYS) fence_acq_rel_sys();
  else fence_release();
}

constexpr uint32_t F32_EMPTY = mb::sentinel::F32_FILL_WORD, BF16X2_EMPTY = mb::sentinel::BF16_FILL_WORD;
// A value as the slots hold it: -0.0 stored as +0.0 (fp32), 0xFFFF as 0x7FC0 (each bf16 of a pair)
MK_DEV uint32_t f32_slot(float v) {
  const uint32_t u = f2u(v);
  return u == mb::sentinel::F32_SENTINEL ? mb::sentinel::F32_REPLACEMENT : u;
}
MK_DEV uint32_t bf16x2_slot(uint32_t w) {
  const uint32_t lo = w & 0xffffu, hi = w >> 16;
  return (lo == mb::sentinel::BF16_SENTINEL ? mb::sentinel::BF16_REPLACEMENT : lo) |
         ((hi == mb::sentinel::BF16_SENTINEL ? mb::sentinel::BF16_REPLACEMENT : hi) << 16);
}
MK_DEV bool bf16x2_ready(uint32_t w) {
  return (w & 0xffffu) != mb::sentinel::BF16_SENTINEL && (w >> 16) != mb::sentinel::BF16_SENTINEL;
}

// The copy layer l uses: layers alternate, and so do steps of odd L (the step's parity), so that
// consecutive layers across a step boundary use different copies too.
MK_DEV int recv_copy(const Blk& b, int layer) { return (layer + b.parity * L) & 1; }
MK_DEV unsigned char* peer_recv(const Params& p, int rank) { return p.peers[rank]; }
MK_DEV float* ar_slot(unsigned char* base, int copy, int g, int t, int n) {
  return reinterpret_cast<float*>(base + RECV_AR) + (static_cast<size_t>(copy * TP_GROUPS + g) * T_MAX + t) * D + n;
}
MK_DEV uint16_t* act_slot(unsigned char* base, int copy, int s, int r, int c) {
  return reinterpret_cast<uint16_t*>(base + RECV_ACT) + (static_cast<size_t>(copy * MAX_SLOTS + s) * 16 + r) * F + c;
}
MK_DEV uint16_t* y_slot(unsigned char* base, int copy, int s, int r, int c) {
  return reinterpret_cast<uint16_t*>(base + RECV_Y) + (static_cast<size_t>(copy * MAX_SLOTS + s) * 16 + r) * P + c;
}

// A collective wait's id (program.py WHAT_AR ...): op index * 16 + code, the rank whose data is
// awaited at bits 16..19, the slot (the all-reduce's K group, a gather's expert slot) from bit 20.
static_assert(TP <= 16 && MAX_SLOTS < 4096 && TP_GROUPS < 4096, "a collective wait's id holds its rank and slot");
MK_DEV uint32_t what_x(uint32_t what, uint32_t code, int src, int slot) {
  return (what & 0xFFF0u) | code | (static_cast<uint32_t>(src) << 16) | (static_cast<uint32_t>(slot) << 20);
}

// A bounded poll's clock: call poll_again after each round that found a word still empty. False
// when the wait must end: the bound passed (reported: `what`, the word's address, the sentinel,
// the word seen) or another wait of the launch gave up.
struct PollClock {
  uint64_t t0 = 0;
  uint32_t it = 0;
};
MK_DEV bool poll_again(const Params& p, PollClock& c, uint32_t what, const void* addr, uint32_t empty, uint32_t seen) {
  if (c.it == 0) c.t0 = now_ns();
  backoff(POLL_BACKOFF_NS);
  if ((++c.it & 63u) == 0u) {
    const uint64_t dt = now_ns() - c.t0;
    if (dt > SPIN_BOUND_NS) {
      report(p, what, addr, empty, seen, dt);
      return false;
    }
    if (tripped(p)) return false;
  }
  return true;
}

// The profiler's view of a collective wait (profiled builds only). Detail builds stamp an "xwait"
// phase around the block's poll (arg: 0 the all-reduce, 1 the activations' gather, 2 the outputs'
// gather: profile_events.XWAITS); every profiled build ends the op's wait phase, on this block, at
// the end of its first such poll (compute_loop), not at its first unit's opening: the wait for the
// other ranks is the op's wait. Every compute thread calls xwait_end (a barrier, so that the end is
// the block's: every thread holds its words).
MK_DEV void xwait_begin(const Blk& b, uint32_t code) { detail_stamp(b, MK_EV_XWAIT_BEGIN, code); }
MK_DEV void xwait_end(const Blk& b, uint32_t code) {
  if constexpr (PROFILE) {
    sync_compute();
    uint64_t& pw = *reinterpret_cast<uint64_t*>(b.misc + MISC_PWAIT);
    if (tid() == 0 && pw == 0) pw = now_ns();
    detail_stamp(b, MK_EV_XWAIT_END, code);
  }
}
MK_DEV bool polls_others(int kind) { return TP > 0 && (kind == OP_ATTN_REDUCE || kind == OP_EXPERT2 || kind == OP_MOE_COMBINE); }

}  // namespace mk
