// The schedule interpreter: op instances from program.py, how many units each has, which block
// runs which unit, what a unit waits for, and the two loops every block runs: the compute warps'
// (wait, run, signal per unit) and the loader warp's (stream each unit's weight chunks).
// The unit/group rules mirror megakernel/program.py. Danger: where the two differ, a wait counts
// units its producer never signals (a hang, ended by the watchdog) or passes early (the emulated
// mega == chain tests under adversarial schedules catch that).
#pragma once
#include "mb/profile.cuh"
#include "mk/layers.cuh"
#include "ops/argmax.cuh"
#include "ops/attention.cuh"
#include "ops/attn_combine.cuh"
#include "ops/embed.cuh"
#include "ops/expert_gemm1.cuh"
#include "ops/expert_gemm2.cuh"
#include "ops/lm_head.cuh"
#include "ops/moe_combine.cuh"
#include "ops/oproj.cuh"
#include "ops/pool.cuh"
#include "ops/qkv_rope.cuh"
#include "ops/router.cuh"
#include "ops/topk.cuh"
#include "ops/tp_experts.cuh"
#include "ops/tp_oproj.cuh"
#include "ops/unpool.cuh"
// the speculative step's ops (spec programs only: program.py build's `spec`)
#include "ops/accept.cuh"
#include "ops/advance.cuh"
#include "ops/compact.cuh"
#include "ops/seed.cuh"
#include "ops/tree.cuh"

namespace mk {

struct Op {
  int kind, layer, counter, group_base, n_groups, rot, assign, n_deps;
  int dep_op[MAX_DEPS], dep_mode[MAX_DEPS];
  int signal;  // which of its counters some consumer waits for: SIGNAL_TOTAL | SIGNAL_GROUPS (program.py OpInst.signal)
};

static_assert(sizeof(Op) <= 16 * sizeof(int), "thread 0's copy fits MISC_OP (block.cuh)");

MK_DEV Op load_op(const Params& p, int i) {
  const int32_t* r = p.program + i * OPINST_INTS;
  Op o;
  o.kind = r[0];
  o.layer = r[1];
  o.counter = r[2];
  o.group_base = r[3];
  o.n_groups = r[4];
  o.rot = r[5];
  o.assign = r[6];
  o.n_deps = r[7];
  for (int d = 0; d < MAX_DEPS; ++d) {
    o.dep_op[d] = r[OPREC_DEPS + 2 * d];
    o.dep_mode[d] = r[OPREC_DEPS + 1 + 2 * d];
  }
  o.signal = r[OPREC_DEPS + 2 * MAX_DEPS];  // after the dependency pairs (program.py OpInst.encode)
  return o;
}
// Row groups: whose rows op instance i runs (program.py OpInst.group; the record's last int). Not a
// field of Op: a build without groups keeps the record it had (its copy in MISC_OP is a store per op)
MK_DEV int op_group(const Params& p, int i) {
  if constexpr (GROUPS > 1) return p.program[i * OPINST_INTS + OPREC_DEPS + 2 * MAX_DEPS + 1];
  return 0;
}

MK_DEV bool has_weights(int kind) {
  return kind == OP_QKV || kind == OP_OPROJ || kind == OP_ROUTER || kind == OP_POOL || kind == OP_EXPERT1 ||
         kind == OP_EXPERT2 || kind == OP_UNPOOL || kind == OP_LM_HEAD;
}
// Unit count known only after the routing of this layer (its first dependency is top-k).
MK_DEV bool is_dynamic(int kind) { return kind == OP_EXPERT1 || kind == OP_EXPERT2; }

MK_DEV int n_units(const Blk& b, const Op& o) {
  if constexpr (TP > 0) {  // tensor parallelism's own unit counts (a build without TP has none of this code)
    if (o.kind == OP_OPROJ) return OPROJ_GR * OPROJ_TILES;
    if (o.kind == OP_ATTN_REDUCE) return OPROJ_TILES;
  }
  switch (o.kind) {
    case OP_EMBED: return step_rows(b);
    case OP_QKV: return QKV_ROWS / TILE_QKV_ROWS;
    case OP_ATTN: return HKV * attn_span(b, o.layer);
    case OP_ATTN_COMBINE: return HQ * step_rows(b);
    case OP_OPROJ: return D / TILE_OPROJ_ROWS;
    case OP_ROUTER: return E / TILE_ROUTER_ROWS;
    case OP_POOL: return P / TILE_POOL_ROWS;
    case OP_TOPK: return 1;
    case OP_EXPERT1: return ldg_cgi(routed_count(b)) * EXP1_TILES;
    case OP_EXPERT2: return ldg_cgi(routed_count(b)) * EXP2_TILES;
    case OP_MOE_COMBINE: return P / MOE_COMBINE_COLS;
    case OP_UNPOOL: return D / TILE_UNPOOL_ROWS;
    case OP_LM_HEAD: return V / 16;
    case OP_ARGMAX: return 1;
    case OP_SEED: return step_nreq(b);
    case OP_TREE: return step_nreq(b);
    case OP_ACCEPT: return step_nreq(b);
    case OP_COMPACT: return L * HKV * step_nreq(b);
    case OP_ADVANCE: return 1;
  }
  return 0;
}

// group counter (relative) a unit bumps, -1 if its op has no groups
MK_DEV int unit_group(const Blk& b, const Op& o, int u) {
  switch (o.kind) {
    case OP_QKV: {
      const int head = u * TILE_QKV_ROWS / HD;
      return head < HQ ? head / G : (head < HQ + HKV ? head - HQ : head - HQ - HKV);
    }
    case OP_ATTN: return u / attn_span(b, o.layer);
    case OP_EXPERT1: return u / EXP1_TILES;
  }
  return -1;
}
MK_DEV int group_size(const Blk& b, const Op& o) {
  switch (o.kind) {
    case OP_QKV: return (G + 2) * HD / TILE_QKV_ROWS;
    case OP_ATTN: return attn_span(b, o.layer);
    case OP_EXPERT1: return EXP1_TILES;
  }
  return 0;
}
// the group of producer `pr` that unit u of consumer `o` needs
MK_DEV int needed_group(const Blk& b, const Op& o, const Op& pr, int u) {
  if (o.kind == OP_ATTN) return u / attn_span(b, o.layer);       // <- qkv, by kv head
  if (o.kind == OP_ATTN_COMBINE) return (u / step_rows(b)) / G;  // <- attn, by kv head
  if (o.kind == OP_EXPERT2) return u / EXP2_TILES;                 // <- expert1, by slot
  return 0;
}

MK_DEV uint32_t* counters(const Blk& b) { return b.p->counters + b.parity * b.p->n_counters; }

// Top-k's counter carries the layer's slot count above ROUTE_SHIFT (program.py; it has one unit,
// so its waiters' target of 1 is unchanged): a routed op learns its unit count from the load that
// ends its routing wait instead of reading n_slots in a second round trip after it.
static_assert(T_MAX * TOPK < (1 << (32 - ROUTE_SHIFT)) && MAX_USLOTS < (1 << (32 - ROUTE_SHIFT)),
              "the slot count (and the union's, Plan.max_uslots) fits above ROUTE_SHIFT");
static_assert(WARPS >= MAX_DEPS, "a routed op's dependencies are waited for by one warp each");
MK_DEV int slot_tiles(int kind) { return kind == OP_EXPERT1 ? EXP1_TILES : EXP2_TILES; }

// The count an "all" wait on producer pr waits for: its units, and with Plan.union_experts
// every active group's units for the kinds whose instances all bump group 0's counter (top-k and
// the pooler: UNION_SHARED_MASK, rendered from plan.UNION_SHARED). Top-k's is then met once the union's builder signalled (its slot
// count, above ROUTE_SHIFT, exceeds any unit count): it took the last ticket, so every group's
// routing was released before its own release (ops/topk.cuh union_build).
MK_DEV uint32_t all_target(const Blk& b, const Op& pr) {
  uint32_t n = static_cast<uint32_t>(n_units(b, pr));
  if constexpr (UNION_EXPERTS)
    if ((UNION_SHARED_MASK >> pr.kind) & 1u) n *= static_cast<uint32_t>(b.p0->n_active);
  return n;
}
// Wait for a dependency of unit u of op o, given as its producer's op index and its mode
// (Op.dep_op[d], dep_mode[d]); returns the counter value that satisfied it (wait_counter_seen).
MK_DEV Seen wait_dep_seen(const Blk& b, const Op& o, int dep_op, int dep_mode, int u, uint32_t what) {
  const Op pr = load_op(*b.p, dep_op);
  if (dep_mode == DEP_ALL) return wait_counter_seen(*b.p, counters(b) + pr.counter, all_target(b, pr), what);
  const int g = needed_group(b, o, pr, u);
  return wait_counter_seen(*b.p, counters(b) + pr.group_base + g, static_cast<uint32_t>(group_size(b, pr)), what);
}
// Thread 0: wait for dependency d of unit u of op instance i.
MK_DEV bool wait_dep(const Blk& b, int i, const Op& o, int d, int u, uint32_t what) {
  return wait_dep_seen(b, o, o.dep_op[d], o.dep_mode[d], u, what).ok;
}
// Thread 0: wait for what unit u needs, skipping what an earlier unit of this op instance on this
// block already waited for (an "all" dependency once; a group dependency once per group). Each
// skipped wait saves an acquire load (which also invalidates L1) on the unit's critical path.
struct DepCache {
  uint32_t all_done;  // bit d: dependency d ("all") satisfied
  int group_done[MAX_DEPS];  // dependency d ("group"): the group last satisfied
};
static_assert(MAX_DEPS == 3, "compute_loop initialises DepCache.group_done with three -1s");
MK_DEV bool wait_unit(const Blk& b, int i, const Op& o, int u, DepCache& dc) {
  for (int d = 0; d < o.n_deps; ++d) {
    const uint32_t what = static_cast<uint32_t>(i * 16 + d);
    if (o.dep_mode[d] == DEP_SENTINEL) continue;  // the op polls the data itself (ops/topk.cuh)
    if (o.dep_mode[d] == DEP_LOCAL) continue;  // this block ran the producer's unit u before (program.py)
    if (o.dep_mode[d] == DEP_ALL) {
      if ((dc.all_done >> d) & 1u) continue;
      if (!wait_dep(b, i, o, d, u, what)) return false;
      dc.all_done |= 1u << d;
    } else {
      const Op pr = load_op(*b.p, o.dep_op[d]);
      const int g = needed_group(b, o, pr, u);
      if (g == dc.group_done[d]) continue;
      if (!wait_dep(b, i, o, d, u, what)) return false;
      dc.group_done[d] = g;
    }
  }
  return true;
}

// Every compute thread: whether unit u, run after unit `prev` of the same op instance on this
// block, opens with warp 1's slot fetch, thread 0's dependency wait and the barrier after them.
// Not when the op's dependencies are all "all" ones (waited for once, before its first unit) or,
// for a routed op, when u is of prev's slot (warp 1 has its record; expert GEMM 2's group
// dependency is by slot). Safe: the barrier that closed `prev` already ordered everything u
// reads, and a skipped opening is a whole barrier with nothing to wait for.
MK_DEV bool unit_opens(const Op& o, int u, int prev) {
  if (is_dynamic(o.kind)) return u / slot_tiles(o.kind) != prev / slot_tiles(o.kind);
  bool group = false;
#pragma unroll
  for (int d = 0; d < MAX_DEPS; ++d) group |= d < o.n_deps && o.dep_mode[d] == DEP_GROUP;
  return group;
}

// Warp 1, before the barrier that starts unit u of a routed op, while thread 0 waits for the
// unit's dependencies: the unit's slot record (expert, token count; gate/up: its token list into
// MISC_ROWS), tagged with the slot's operand tag, unless it is there already. Fetched after that
// barrier (thread 0, then one more barrier), its round trip came after expert GEMM 2's wait for
// the slot's gate/up group. Safe: every reader of the previous record passed the barrier after
// the previous unit.
MK_DEV void slot_fetch(Blk& b, int kind, int layer, int u) {
  // fused: the down projection's record is gate/up's (same expert and count; its token rows
  // are not read again): a block whose units lie in one slot reuses it
  const int s = unit_slot(*b.p, u / slot_tiles(kind));
  const int tag = tag_of(kind == OP_EXPERT1 || FUSED_EXPERTS ? TAG_EXP1 : TAG_EXP2, layer, s);
  int* info = b.misc + MISC_SLOT;
  const bool have = info[2] == tag;  // written by this warp before the last barrier
  // Danger: lane 0 rewrites the tag below; a lane that read it afterwards would skip its row
  syncwarp();
  if (have) return;
  const Params& p = *b.p;
  if constexpr (UNION_EXPERTS) {
    // gate/up: its rows in the stacked pooled; the split down projection: its outputs' rows in the
    // stacked yexp. The fused one shares gate/up's record (its tag) and reads its rows itself
    // (ops/expert_gemm2.cuh), so the record's rows are always gate/up's there
    if (lane() < 16 && (kind == OP_EXPERT1 || !FUSED_EXPERTS))
      b.misc[MISC_ROWS + lane()] = ldg_cgi((kind == OP_EXPERT1 ? p.u_row : p.u_dst) + s * 16 + lane());
    if (lane() == 0) {
      info[0] = ldg_cgi(p.u_expert + s);
      info[1] = ldg_cgi(p.u_ntok + s);
      info[2] = tag;
    }
    return;
  }
  if (kind == OP_EXPERT1 && lane() < 16) b.misc[MISC_ROWS + lane()] = ldg_cgi(p.slot_tok + s * 16 + lane());
  if (lane() == 0) {
    info[0] = ldg_cgi(p.slot_expert + s);
    info[1] = ldg_cgi(p.slot_ntok + s);
    info[2] = tag;
  }
}

// Thread 0: units finished but not yet published. Counters are bumped once per group run and
// once per op instance (not per unit): every consumer of an op needs all of it, or all of a
// group, and a block never waits inside an op for its own pending signals (deps point to earlier
// ops), so publishing at group change / op end cannot deadlock; it saves a release (which waits
// for the unit's stores to reach L2) on every unit. Only the counters some consumer waits for are
// bumped (Op.signal): an op waited for by group skips its total, whose release would come last,
// a whole fence on the op's critical path.
// A group the block finished inside an op (not its last) is held and released with the op's end,
// under the same fence, instead of stalling the block for a fence in the middle of the op: its
// consumers (expert GEMM 2 units of that slot, on this block and its neighbours) wait for the
// slot's other blocks, which end their GEMM 1 about when this one does.
struct Pending {
  uint32_t total;
  int group;
  uint32_t in_group;
  uint32_t held;  // a finished earlier group, (group << 16) | units; 0: none
};
static_assert(sizeof(Pending) == 4 * 4, "block.cuh MISC_PEND reserves 4 ints");
MK_DEV void flush_group(const Blk& b, const Op& o, Pending& pd) {
  if (pd.in_group) {
    detail_stamp(b, MK_EV_PUBLISH_BEGIN, 1);
    red_release(counters(b) + o.group_base + pd.group, pd.in_group);
    detail_stamp(b, MK_EV_PUBLISH_END, 1);
  }
  pd.in_group = 0;
}
MK_DEV void signal_unit(const Blk& b, const Op& o, int u, Pending& pd) {
  const int g = o.signal & SIGNAL_GROUPS ? unit_group(b, o, u) : -1;
  if (g >= 0 && g != pd.group) {
    if (pd.in_group && !pd.held) {
      pd.held = (static_cast<uint32_t>(pd.group) << 16) | pd.in_group;
      pd.in_group = 0;
    }
    flush_group(b, o, pd);  // a third group: the second is released now
    pd.group = g;
  }
  if (g >= 0) ++pd.in_group;
  ++pd.total;
}
MK_DEV void signal_op_end(const Blk& b, const Op& o, Pending& pd) {
  const bool total = pd.total && (o.signal & SIGNAL_TOTAL);
  if (!pd.held && !pd.in_group && !total) return;
  detail_stamp(b, MK_EV_PUBLISH_BEGIN, 0);
  fence_release();  // one fence for every counter the op still owes
  uint32_t* ctr = counters(b);
  if (pd.held) red_relaxed(ctr + o.group_base + (pd.held >> 16), pd.held & 0xffffu);
  if (pd.in_group) red_relaxed(ctr + o.group_base + pd.group, pd.in_group);
  // top-k (one unit, so pd.total is 1) adds its slot count above ROUTE_SHIFT
  const uint32_t route = o.kind == OP_TOPK ? static_cast<uint32_t>(b.misc[MISC_NSLOTS]) << ROUTE_SHIFT : 0u;
  if (total) red_relaxed(ctr + o.counter, pd.total + route);
  detail_stamp(b, MK_EV_PUBLISH_END, 0);
  pd.held = pd.in_group = 0;
}

struct UnitRange {
  int begin, end, step;
};
// This block's units of op o: a contiguous share, or every nb-th unit from the op's rotation
// (program.py assigned_units mirrors this). Row groups also rotate the contiguous shares
// (program.grouped): an op of fewer units than blocks would otherwise put every group's units on
// the same blocks, one group after another, while the rest of the grid idles.
MK_DEV UnitRange my_units(const Op& o, int total) {
  const int nb = nblocks(), me = bid();
  if (o.assign == ASSIGN_CONTIG) {
    const int m = GROUPS > 1 ? ((me - o.rot) % nb + nb) % nb : me;
    return UnitRange{m * total / nb, (m + 1) * total / nb, 1};
  }
  return UnitRange{((me - o.rot) % nb + nb) % nb, total, nb};
}

MK_DEV void run_unit(Blk& b, int i, const Op& o, int u) {
  const uint32_t what = static_cast<uint32_t>(i * 16) + WHAT_RING_FULL;
  if constexpr (TP > 0) {  // tensor parallelism's ops (ops/tp_oproj.cuh, ops/tp_experts.cuh)
    if (o.kind == OP_OPROJ) return run_oproj_tp(b, o.layer, u, what);
    if (o.kind == OP_ATTN_REDUCE) return run_attn_reduce(b, o.layer, u, what);
    if (o.kind == OP_EXPERT1) return run_expert1_tp(b, o.layer, u, what);
    if (o.kind == OP_EXPERT2) return run_expert2_tp(b, o.layer, u, what);
    if (o.kind == OP_MOE_COMBINE) return run_moe_combine_tp(b, o.layer, u, what);
  }
  switch (o.kind) {
    case OP_EMBED: run_embed(b, u); break;
    case OP_QKV: run_qkv(b, o.layer, u, what); break;
    case OP_ATTN: run_attn(b, o.layer, u); break;
    case OP_ATTN_COMBINE: run_attn_combine(b, o.layer, u); break;
    case OP_OPROJ: run_oproj(b, o.layer, u, what); break;
    case OP_ROUTER: run_router(b, o.layer, u, what); break;
    case OP_POOL: run_pool(b, o.layer, u, what); break;
    case OP_TOPK: run_topk(b, o.layer, static_cast<uint32_t>(i * 16) + WHAT_SENTINEL,
                             UNION_EXPERTS ? counters(b) + o.group_base : nullptr);  // the union's ticket
      break;
    case OP_EXPERT1:
      // LAYOUT_GAP (Plan.layout_gap), a placebo for A/Bs: never-run instructions (u is never
      // negative) in the middle of the ops' code, moving the code nvcc lays out after them
      // against the code before (megakernel.cu LAYOUT_PAD moves the whole body)
      if constexpr (LAYOUT_GAP > 0) {
        if (u < 0) {
#pragma unroll
          for (int k = 0; k < LAYOUT_GAP / 16; ++k) backoff(static_cast<unsigned>(k + 1));
        }
      }
      run_expert1(b, o.layer, u, what);
      break;
    case OP_EXPERT2: run_expert2(b, o.layer, u, what); break;
    case OP_MOE_COMBINE: run_moe_combine(b, u); break;
    case OP_UNPOOL: run_unpool(b, o.layer, u, what); break;
    case OP_LM_HEAD: run_lm_head(b, o.layer, u, what); break;
    case OP_ARGMAX: run_argmax(b); break;
    case OP_SEED: run_seed(b, u); break;
    case OP_TREE: run_tree(b, u); break;
    case OP_ACCEPT: run_accept(b, u); break;
    case OP_COMPACT: run_compact(b, u); break;
    case OP_ADVANCE: run_advance(b); break;
  }
}

MK_DEV bool load_unit(const Blk& b, int i, const Op& o, int u, unsigned& c, LoaderSlot& ls) {
  const uint32_t what = static_cast<uint32_t>(i * 16) + WHAT_RING_EMPTY;
  if constexpr (TP > 0) {
    if (o.kind == OP_OPROJ) return load_oproj_tp(b, o.layer, u, c, what);
    if (o.kind == OP_EXPERT1) return load_expert1_tp(b, ls, o.layer, u, c, what);
    if (o.kind == OP_EXPERT2) return load_expert2_tp(b, ls, o.layer, u, c, what);
  }
  switch (o.kind) {
    case OP_QKV: return load_qkv(b, o.layer, u, c, what);
    case OP_OPROJ: return load_oproj(b, o.layer, u, c, what);
    case OP_ROUTER: return load_router(b, o.layer, u, c, what);
    case OP_POOL: return load_pool(b, o.layer, u, c, what);
    case OP_EXPERT1: return load_expert1(b, ls, o.layer, u, c, what);
    case OP_EXPERT2: return load_expert2(b, ls, o.layer, u, c, what);
    case OP_UNPOOL: return load_unpool(b, o.layer, u, c, what);
    case OP_LM_HEAD: return load_lm_head(b, o.layer, u, c, what);
  }
  return true;
}

// The compute warps. Every wait is done by thread 0 and agreed on through a barrier-reduction,
// and a ring wait that gives up only sets b.failed (control flow never diverges inside a unit),
// so a broken dependency stops all compute warps at the same unit boundary instead of leaving
// some of them at a barrier forever. Thread 0 also stamps the profiler (compiled out unless
// PROFILE) and, for the loader's LOADER_AHEAD=0 mode, publishes how many ops it has finished.
MK_DEV uint32_t ev_wait_begin(int kind) { return MK_EV_WAIT_EMBED_BEGIN + 4u * kind; }  // layout: profile_events.py
MK_DEV uint32_t ev_work_begin(int kind) { return ev_wait_begin(kind) + 2u; }

// Op phase stamps, deferred (profiled builds without detail stamps). A record written where the
// phase changes holds thread 0 there while the other warps wait at the next barrier, at every op
// of every block. So thread 0 only saves the instants (a timer read and a shared-memory store at
// the op's slot) and, when the op ends, reserves its four records; the compute warps write them
// together when PROF_OPS ops are done and at launch end (prof_flush), one record per thread, in
// op order. Detail builds stamp inside units and keep immediate records (mb/profile.cuh). `rec`
// (the host passed a buffer for this launch) gates all of it (Engine.profile_launches), tested
// once per op, and the slots are indexed by mask.
// Danger: a profiled build is slower than the unprofiled one even where it records nothing: the
// flag tests and slot arithmetic below run per op and per unit, and the expert GEMM gets extra
// address arithmetic. Compare a profiled build's times with a profiled build's.
constexpr bool PROF_DEFER = PROFILE && !PROFILE_DETAIL;
struct ProfSlot {
  int op;        // the op whose instants these are (valid in the window that holds op; -1: none)
  uint32_t rec;  // its first reserved record << 8 | kind + 1, set when the op ended on this block
  uint64_t t[3];  // wait begin, wait end = work begin, work end
};
static_assert(sizeof(ProfSlot) == 8 * 4, "block.cuh MISC_PSLOT reserves 8 ints per op");
static_assert(OP_KINDS < 255, "ProfSlot.rec keeps kind + 1 in 8 bits");
MK_DEV ProfSlot* prof_slot(const Blk& b, int k) { return reinterpret_cast<ProfSlot*>(b.misc + MISC_PSLOT) + k; }
// op i's slot: i - first >= 0, so an unsigned mask (PROF_OPS a power of two) instead of signed %
MK_DEV ProfSlot* prof_slot_of(const Blk& b, int i, int first) {
  return prof_slot(b, static_cast<int>(static_cast<unsigned>(i - first) & (PROF_OPS - 1u)));
}
static_assert((PROF_OPS & (PROF_OPS - 1)) == 0, "prof_slot_of masks with PROF_OPS - 1");

// Every compute thread calls (barriers inside). Thread 4k + r writes record r of slot k when the
// slot's op lies in the current window (MISC_PWIN), so nothing is counted or cleared here: a
// slot left from an earlier window, or by an op this block had no unit of, names another op.
// `more`: the launch goes on, so thread 0 may reuse the slots only after every writer read them.
MK_DEV void prof_flush(Blk& b, mb::prof::Profiler& prof, bool more) {
  if constexpr (PROF_DEFER) {
    sync_compute();  // thread 0's last slot writes
    const int w0 = b.misc[MISC_PWIN];
    if (tid() < 4 * PROF_OPS) {
      const int k = tid() / 4, r = tid() % 4;
      const ProfSlot& s = *prof_slot(b, k);
      if (s.op == w0 + k) {
        const uint32_t ev = ev_wait_begin(static_cast<int>(s.rec & 0xFFu) - 1) + static_cast<uint32_t>(r);
        prof.put_at((s.rec >> 8) + static_cast<uint32_t>(r), s.t[(r + 1) / 2], ev, static_cast<uint32_t>(s.op));
      }
    }
    if (more) {
      sync_compute();
      if (tid() == 0) b.misc[MISC_PWIN] = w0 + PROF_OPS;
    }
  }
}

// Where a routed op keeps the slot count its routing wait read (block.cuh MISC_ROUTED). Unfused,
// gate/up and down take a copy each, so a layer's down projection never overwrites the copy its
// gate/up's slower warps may still read; fused, the down projection writes none and reads its
// gate/up's, so the copy alternates by layer. Invariant: between two writes of one copy, every
// compute thread passes a routed op's barrier (sync_compute_or), after its reads of that copy.
// Row groups: each group has its own two copies (the groups' routed ops interleave).
MK_DEV int routed_slot(const Blk& b, const Op& o) {
  const int copy = FUSED_EXPERTS ? (o.layer & 1) : (o.kind == OP_EXPERT2 ? 1 : 0);
  if constexpr (GROUPS > 1) return MISC_GROUTED + 2 * b.group + copy;
  return MISC_ROUTED + copy;
}

MK_DEV void compute_loop(Blk& b, int first, int nops, mb::prof::Profiler& prof, bool rec) {
  volatile int* ops_done = b.misc + MISC_OPS_DONE;
  for (int i = first; i < first + nops; ++i) {
    const Op o = load_op(*b.p, i);
    enter_group(b, op_group(*b.p, i), true);
    bool fail = false;
    // a dynamic op's wait phase starts before its routing wait (the block may have no unit of it;
    // the instant is recorded with its first unit): stamped at the first unit, the time a block
    // spent waiting for top-k fell between two records and counted as neither wait nor work
    // thread 0 of a recorded launch stamps: one test per op, not per unit
    const bool stamp = PROFILE && rec && tid() == 0;
    uint64_t t_route = 0;
    // a routed op's "all" dependencies are all waited for here, at once: dependency d by lane 0
    // of warp d, the routing (d = 0) by thread 0, whose counter carries the slot count. Waited
    // for in turn, each after the routing would cost one more acquire round trip between top-k's
    // signal and the op. One call site: the wait's code is inlined once.
    uint32_t pre = 0u;  // bit d: dependency d is satisfied from here (DepCache)
    // fused: the down projection follows gate/up of its layer on this block, which waited for
    // the routing and left its slot count in its routed_slot (every block waits, with units or not)
    const bool routed_here = FUSED_EXPERTS && o.kind == OP_EXPERT2 && b.wait;  // chain mode: a launch of its own
    if (is_dynamic(o.kind)) {
      if (stamp) t_route = now_ns();
      if (routed_here) {
        pre = 1u;  // dependency 0 (top-k); its other one is block-local (DEP_LOCAL)
      } else if (b.wait) {
        // this warp's dependency from the op's record in global memory: indexing the register
        // copy `o` by warp would put it on the stack
        const int d = warp();
        const int32_t* rec_d = b.p->program + i * OPINST_INTS + OPREC_DEPS + 2 * d;
        if (lane() == 0 && d < o.n_deps && rec_d[1] == DEP_ALL) {
          const Seen w = wait_dep_seen(b, o, rec_d[0], DEP_ALL, 0, static_cast<uint32_t>(i * 16 + d));
          fail = !w.ok;
          if (d == 0) b.misc[routed_slot(b, o)] = static_cast<int>(w.v >> ROUTE_SHIFT);
        }
#pragma unroll
        for (int k = 0; k < MAX_DEPS; ++k)  // constant indices: `o` stays in registers
          if (k < o.n_deps && o.dep_mode[k] == DEP_ALL) pre |= 1u << k;
      } else if (tid() == 0) {
        b.misc[routed_slot(b, o)] = ldg_cgi(routed_count(b));  // chain mode: top-k's launch has ended
      }
      if (sync_compute_or(fail)) return;  // the routing is visible to every thread from here
    }
    const int total = is_dynamic(o.kind) ? b.misc[routed_slot(b, o)] * slot_tiles(o.kind) : n_units(b, o);
    const UnitRange r = my_units(o, total);
    bool first_unit = true;
    // thread 0's bookkeeping, and the op record its waits and signals read, live in shared
    // memory: as registers they are live across every op's code (the record alone is 14 ints)
    // and pushed the kernel past its 168-register budget (spills in shard8)
    DepCache& dc = *reinterpret_cast<DepCache*>(b.misc + MISC_DEPS);
    Pending& pd = *reinterpret_cast<Pending*>(b.misc + MISC_PEND);
    Op& o0 = *reinterpret_cast<Op*>(b.misc + MISC_OP);
    if (tid() == 0) {
      // a dynamic op already waited for its "all" dependencies above: not repeated for its units
      dc = DepCache{pre, {-1, -1, -1}};
      pd = Pending{0u, -1, 0u, 0u};
      o0 = o;
      // TP: the end of this block's first poll of other ranks' data (mk/tp.cuh xwait_end), 0: none yet
      if constexpr (TP > 0 && PROFILE) *reinterpret_cast<uint64_t*>(b.misc + MISC_PWAIT) = 0;
    }
    // run_unit reads the record from shared memory (published by the barrier before it), so the
    // register copy is dead through the units (only profiler builds keep its kind for stamps)
    // the range's end, negated for a strided assignment, carries the stride too (1, or
    // nblocks_here: %nctaid.x read where used). Danger: a separate flag or stride is one more
    // value live across every op's code, and at 168 registers the compiler spills it
    const int lim = o.assign == ASSIGN_CONTIG ? r.end : -r.end;
    for (int u = r.begin; u < (lim < 0 ? -lim : lim); u += lim < 0 ? nblocks_here() : 1) {
      if (first_unit && tid() == 0) {
        if (PROF_DEFER) {
          if (stamp) prof_slot_of(b, i, first)->t[0] = is_dynamic(o.kind) ? t_route : now_ns();
        } else if (is_dynamic(o.kind)) {
          prof.put_at(prof.reserve(1), t_route, ev_wait_begin(o.kind), i);
        } else {
          prof.stamp(ev_wait_begin(o.kind), i);
        }
      }
      // the first unit's opening is the op's wait phase, stamped above; stamped as unit_open too,
      // it would fall before the op's phase and count as the previous op's (pipeline.detail_by_op)
      // (o0 is valid from the first unit's opening barrier on)
      const bool opens = first_unit || unit_opens(o0, u, u - (lim < 0 ? nblocks_here() : 1));
      const bool open_stamp = !first_unit && opens;
      if (open_stamp) detail_stamp(b, MK_EV_UNIT_OPEN_BEGIN, static_cast<uint32_t>(u));
      if (opens) {
        // the register copy of the op: o0 is published only by the barrier below
        if (is_dynamic(o.kind) && warp() == 1) slot_fetch(b, o.kind, o.layer, u);
        if (b.wait && tid() == 0) fail = !wait_unit(b, i, o0, u, dc);
        if (first_unit) {
          if (tid() == 0) {
            if (PROF_DEFER) {
              if (stamp) prof_slot_of(b, i, first)->t[1] = now_ns();
            } else if (!(SENTINEL_ROUTE && o.kind == OP_TOPK)) {  // top-k stamps these after its poll
              prof.stamp(ev_wait_begin(o.kind) + 1, i);
              prof.stamp(ev_work_begin(o.kind), i);
            }
          }
          first_unit = false;
        }
        if (sync_compute_or(fail || b.failed)) return;
      }
      if (open_stamp) detail_stamp(b, MK_EV_UNIT_OPEN_END, static_cast<uint32_t>(u));
      sched_unit(i, u, total);  // the emulation's adversarial schedule (nothing on the GPU)
      run_unit(b, i, o0, u);
      detail_stamp(b, MK_EV_UNIT_CLOSE_BEGIN, static_cast<uint32_t>(u));
      if (sync_compute_or(b.failed)) return;
      if (b.wait && tid() == 0 && o0.signal) signal_unit(b, o0, u, pd);
      detail_stamp(b, MK_EV_UNIT_CLOSE_END, static_cast<uint32_t>(u));
    }
    // after the last unit's barrier; an op nobody waits for skips the release (its fence waits
    // for the op's stores to drain)
    if (b.wait && tid() == 0 && o0.signal) signal_op_end(b, o0, pd);
    if (!first_unit && tid() == 0) {
      if (PROF_DEFER) {
        if (stamp) {
          ProfSlot& ps = *prof_slot_of(b, i, first);
          // top-k with sentinel slots waits inside the op: its wait phase ends when the poll did
          if (SENTINEL_ROUTE && o.kind == OP_TOPK) ps.t[1] = *reinterpret_cast<const uint64_t*>(b.misc + MISC_PWAIT);
          // TP: an op that polls other ranks' data waits for them inside its first unit (mk/tp.cuh)
          if (polls_others(o.kind) && *reinterpret_cast<const uint64_t*>(b.misc + MISC_PWAIT))
            ps.t[1] = *reinterpret_cast<const uint64_t*>(b.misc + MISC_PWAIT);
          ps.t[2] = now_ns();
          ps.op = i;
          ps.rec = prof.reserve(4u) << 8 | static_cast<uint32_t>(o.kind + 1);
        }
      } else {
        prof.stamp(ev_work_begin(o.kind) + 1, i);
      }
    }
    if (tid() == 0) *ops_done = i - first + 1;
    // every compute thread
    if (PROF_DEFER && rec && ((i - first + 1) & (PROF_OPS - 1)) == 0) prof_flush(b, prof, true);
  }
}

// LOADER_AHEAD=0: the loader may not start an op's weights before the compute warps finished
// the previous op (no cross-op prefetch; the ring still overlaps chunks within an op).
MK_DEV bool loader_gate(const Blk& b, int i, int first) {
  if (LOADER_AHEAD) return true;
  int ok = 1;
  if (lane() == 0) {
    volatile int* ops_done = b.misc + MISC_OPS_DONE;
    const uint64_t t0 = now_ns();
    for (uint32_t k = 1; *ops_done < i - first; ++k) {
      backoff(POLL_BACKOFF_NS);
      if ((k & 63u) == 0u) {
        const uint64_t dt = now_ns() - t0;
        if (dt > SPIN_BOUND_NS) {
          report(*b.p, static_cast<uint32_t>(i * 16) + WHAT_LOADER_GATE, b.misc + MISC_OPS_DONE, i - first,
                 static_cast<uint64_t>(*ops_done), dt);
          ok = 0;
          break;
        }
        if (tripped(*b.p)) {
          ok = 0;
          break;
        }
      }
    }
  }
  return bcast_i(ok) != 0;
}

// The loader warp: streams, ahead of the compute warps by up to RING_STAGES chunks, the weight
// chunks of exactly the units this block will run, in the same order. Weights never depend on
// the previous op, so it runs ahead across op boundaries; only a routed expert's identity does,
// so before a dynamic op it waits (bounded) for this layer's top-k.
MK_DEV void loader_loop(Blk& b, int first, int nops) {
  unsigned c = 0;
  LoaderSlot ls;
  int routed_layer = -1, routed_nslots = 0;  // the last routing this warp waited for (fused: reused)
  for (int i = first; i < first + nops; ++i) {
    const Op o = load_op(*b.p, i);
    if (!has_weights(o.kind)) continue;
    if constexpr (GROUPS > 1) {  // the group's routing: its slot records, and a fused pair's count
      const int g = op_group(*b.p, i);
      if (g != b.group) {
        ls = LoaderSlot{};
        routed_layer = -1;
        b.group = g;
      }
      enter_group(b, g, false);
    }
    if (!loader_gate(b, i, first)) return;
    int nslots = 0;  // a routed op's: from top-k's counter (compute_loop)
    if (is_dynamic(o.kind) && b.wait && FUSED_EXPERTS && o.kind == OP_EXPERT2 && routed_layer == o.layer) {
      nslots = routed_nslots;  // fused: gate/up's routing, waited for just before
    } else if (is_dynamic(o.kind) && b.wait) {
      Seen w{true, 0u};
      if (lane() == 0) w = wait_dep_seen(b, o, o.dep_op[0], o.dep_mode[0], 0, static_cast<uint32_t>(i * 16) + WHAT_LOADER_ROUTE);
      if (!bcast_i(w.ok ? 1 : 0)) return;
      nslots = bcast_i(static_cast<int>(w.v >> ROUTE_SHIFT));
      routed_layer = o.layer;
      routed_nslots = nslots;
    } else if (is_dynamic(o.kind)) {
      nslots = ldg_cgi(routed_count(b));
    }
    const UnitRange r = my_units(o, is_dynamic(o.kind) ? nslots * slot_tiles(o.kind) : n_units(b, o));
    // The opening pace: the ring drained while this warp waited for the routing, and every
    // block's loader sees it at once. Its first chunk is let land before the rest are copied, so
    // that the first chunk does not queue behind every block's whole ring.
    const bool fresh = o.kind == OP_EXPERT1 && b.wait;
    for (int u = r.begin; u < r.end; u += r.step) {
      b.pace = fresh && u == r.begin ? c : ~0u;
      if (!load_unit(b, i, o, u, c, ls)) return;
    }
    b.pace = ~0u;
  }
}

}  // namespace mk
