// topk: per token the k largest router logits (ties: lower expert index first), or the forced
// experts of a synthetic routing; weights = softmax over the selected logits in rank order.
// Then the step's distinct experts in ascending order ("slots"), each slot's token list (tokens
// ascending), and per (token, rank) its slot and row in that list. One unit, one block.
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"
#include "mk/wait.cuh"
#include "mb/sentinel.cuh"

namespace mk {

constexpr int TOPK_PER_LANE = (E + 31) / 32;
static_assert(TOPK <= 32, "lane r holds the rank-r selection");

// Order-preserving key of a logit: a larger float gives a larger key, -0 the key of +0 (equal
// floats, equal keys: a tie still goes to the lower expert). 0 is no logit's key (NaN aside):
// it marks an expert already taken or past E.
MK_DEV uint32_t topk_key(float f) {
  const uint32_t u = f2u(f == 0.f ? 0.f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
MK_DEV float topk_logit(uint32_t k) { return u2f((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// SENTINEL_ROUTE: the router logits arrive in sentinel slots (empty = -0.0, mb/sentinel.cuh;
// router.cuh stores a -0.0 logit as +0.0), so top-k waits for the data itself instead of the
// router's counter: no release fence on the router blocks, no acquire round trip here. Lane l of
// the warp of tokens tt[] polls the words it keys (experts l + 32 i) with all loads in flight,
// until none is empty, bounded like every wait (wait.cuh). Every word the router
// wrote (tokens < T, all experts) is polled by exactly one lane, which resets it afterwards.
MK_DEV bool topk_poll(const Blk& b, const int (&tt)[2], const bool (&ok)[2], uint32_t (&raw)[2][TOPK_PER_LANE],
                      uint32_t what) {
  constexpr uint32_t EMPTY = mb::sentinel::F32_FILL_WORD;
  const float* lg = b.p->router_logits;
  uint64_t t0 = 0;
  // One loop body re-reads every word (a written word stays as it is until this op resets it):
  // top-k's code is fetched cold once per layer, so a second, re-poll-only-the-empty copy of
  // the 16 loads costs more than the redundant loads (L2 hits) it would save.
  for (uint32_t it = 0;; ++it) {
    bool all = true;
    const float* still = nullptr;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < TOPK_PER_LANE; ++i) {
        const int e = lane() + 32 * i;
        const float* a = lg + tt[h] * E + e;
        raw[h][i] = ok[h] && e < E ? ld_relaxed(a) : 0u;  // 0u: +0.0, for words no lane polls
        if (raw[h][i] == EMPTY) all = false, still = a;
      }
    if (all) return true;
    if (it == 0) t0 = now_ns();
    backoff(POLL_BACKOFF_NS);
    if ((it & 63u) == 63u) {
      const uint64_t dt = now_ns() - t0;
      if (dt > SPIN_BOUND_NS) {
        report(*b.p, what, still, EMPTY, EMPTY, dt);
        return false;
      }
      if (tripped(*b.p)) return false;
    }
  }
}
// The logit of expert e from the lanes' polled words (warp-wide: every lane takes part).
MK_DEV float topk_polled(const uint32_t (&raw)[TOPK_PER_LANE], int e) {
  float v = 0.f;
#pragma unroll
  for (int i = 0; i < TOPK_PER_LANE; ++i) {
    const float x = shfl_f(u2f(raw[i]), e & 31);
    if (i == (e >> 5)) v = x;
  }
  return v;
}

// Plan.union_experts: after its own group's routing, each group's top-k takes a ticket (chain mode:
// the groups' launches run in order, so the last group's); the one that takes the last builds the
// union slots in group 0's block, and only its signal carries their count (MISC_NSLOTS; the other
// groups' carry 0). Union slots: experts ascending; an expert's tokens in group order, each group's
// in its slot's order; cut into slots of at most 16 tokens. u_row names a token's row of the
// stacked pooled, u_dst its expert output's row of the stacked yexp (its group's own slot and
// position, which its group's MoE combine reads). Every group released its tables (fence, then
// its ticket) before the builder's ticket acquired them, and the builder's signal releases the
// union: a consumer that saw that signal sees both (program.cuh all_target).
MK_DEV void union_build(Blk& b, uint32_t* ticket) {
  static_assert(E <= COMPUTE_THREADS, "a thread per expert");
  static_assert(2 * E * GROUPS * 4 <= ABUF_BYTES, "the builder's tables fit abuf");
  const Params* g0 = b.p0;
  const int groups = g0->n_active, e = tid();
  int* flag = b.misc + MISC_SCRATCH;  // top-k's scratch, free once its tables are written
  int* base = flag + T_MAX * TOPK + 2 * ((E + 31) / 32);  // [E] (top-k's token masks): slots, then first slot
  // [E][GROUPS] each expert's slot in each group (-1: none), and where that group's tokens start
  // in the expert's token list. In abuf, which holds no staged operand from here (MISC_TAG)
  int* sl_s = reinterpret_cast<int*>(b.abuf);
  int* at_s = sl_s + E * GROUPS;
  sync_compute();  // every thread's stores of this group's tables precede thread 0's release
  if (tid() == 0) {
    bool last = b.group == groups - 1;
    if (b.wait) {
      fence_release();
      last = atom_add_acq_rel(ticket, 1u) == static_cast<uint32_t>(groups - 1);
    }
    flag[0] = last;
    b.misc[MISC_NSLOTS] = 0;
  }
  sync_compute();
  if (!flag[0]) return;
  if (tid() == 0) b.misc[MISC_TAG] = -1;
  // Loads are issued in batches (each loop unrolled over the build's groups, or over a slot's 16
  // rows), so the union costs a few L2 round trips on the layer's critical path. Its code is
  // fetched cold once per layer, as top-k's is: one copy of each loop body, not one per group.
  int n = 0;
  if (e < E) {
    int sl[GROUPS], nt[GROUPS];
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) sl[g] = g < groups ? ldg_cgi(g0[g].expert_slot + e) : -1;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) nt[g] = sl[g] >= 0 ? ldg_cgi(g0[g].slot_ntok + sl[g]) : 0;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
      sl_s[e * GROUPS + g] = sl[g];
      at_s[e * GROUPS + g] = n;
      n += nt[g];
    }
    base[e] = (n + 15) / 16;
  }
  sync_compute();
  if (warp() == 0) {  // exclusive prefix over the experts: lane l sums experts l*PER ..
    constexpr int PER = (E + 31) / 32;
    int sum = 0;
#pragma unroll
    for (int i = 0; i < PER; ++i) sum += lane() * PER + i < E ? base[lane() * PER + i] : 0;
    int incl = sum;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
      const int v = shfl_i(incl, (lane() - m) & 31);
      if (lane() >= m) incl += v;
    }
    int at = incl - sum;
#pragma unroll
    for (int i = 0; i < PER; ++i)
      if (lane() * PER + i < E) {
        const int k = base[lane() * PER + i];
        base[lane() * PER + i] = at;
        at += k;
      }
    if (lane() == 31) {
      *g0->u_nslots = incl;
      b.misc[MISC_NSLOTS] = incl;  // published in top-k's counter (program.cuh signal_op_end)
    }
  }
  sync_compute();
  if (e < E)  // the expert's slots: 16 tokens each, the last the rest
    for (int k = 0; k < n; k += 16) {
      g0->u_expert[base[e] + k / 16] = e;
      g0->u_ntok[base[e] + k / 16] = n - k < 16 ? n - k : 16;
    }
  // a thread per (expert, group): the group's slot's tokens to their places in the union
MK_COLD_LOOP
  for (int i = tid(); i < E * groups; i += COMPUTE_THREADS) {
    const int x = i / groups, g = i % groups, s = sl_s[x * GROUPS + g], k0 = at_s[x * GROUPS + g];
    if (s < 0) continue;
    const int* tok = g0[g].slot_tok + s * 16;
    const int nt = ldg_cgi(g0[g].slot_ntok + s);
    int t[16];
#pragma unroll
    for (int pos = 0; pos < 16; ++pos) t[pos] = ldg_cgi(tok + pos);  // rows past the slot's count: unused
#pragma unroll
    for (int pos = 0; pos < 16; ++pos) {
      const int k = k0 + pos, us = base[x] + k / 16;
      if (pos < nt) {
        g0->u_row[us * 16 + k % 16] = g * T_MAX + t[pos];
        g0->u_dst[us * 16 + k % 16] = (g * MAX_SLOTS + s) * 16 + pos;
      }
    }
  }
}

MK_DEV void run_topk(Blk& b, int layer, uint32_t what, uint32_t* ticket) {
  const Params& p = *b.p;
  int* sel_s = b.misc + MISC_SCRATCH;      // [T_MAX * TOPK] selected expert of (t, rank)
  int* before = sel_s + T_MAX * TOPK;      // [E / 32] slots of the experts in earlier bitmap words
  int* bitmap = before + (E + 31) / 32;    // [E / 32] experts selected by any token
  int* tokmask = bitmap + (E + 31) / 32;   // [E] bit t: token t selected the expert
  if (tid() < (E + 31) / 32) bitmap[tid()] = 0;
MK_COLD_LOOP
  for (int e = tid(); e < E; e += COMPUTE_THREADS) tokmask[e] = 0;
  // A warp per two tokens (w and w + WARPS), both selected together: their logits come in one
  // L2 round trip and their rank steps interleave. Lane r keeps the rank-r selection. A rank is
  // each lane's best remaining key, then the warp's largest key (redux.sync max) and, among the
  // lanes holding it, the lowest expert (redux min). The rank loop is not unrolled: top-k runs
  // once per layer on one block from a cold instruction cache, so its code size is its cost
  // (unrolled over the ranks it is ~27 KB of SASS, on every layer's critical path).
  static_assert(T_MAX <= 2 * WARPS, "two tokens per warp");
  const int tt[2] = {warp(), warp() + WARPS};
  const bool ok[2] = {tt[0] < step_rows(b), tt[1] < step_rows(b)};
  int mysel[2] = {0, 0};
  float myv[2] = {0.f, 0.f};
  uint32_t raw[2][TOPK_PER_LANE] = {};  // SENTINEL_ROUTE: this lane's polled logits (topk_poll)
  if constexpr (SENTINEL_ROUTE) {
    if (!topk_poll(b, tt, ok, raw, what)) b.failed = true;  // garbage from here; the step is reported
    if constexpr (PROFILE) {  // the poll is this op's wait for the router, not its work (program.cuh)
      syncwarp();  // warp 0 has polled every expert of tokens 0 and 8: each router unit wrote them
      if (tid() == 0) *reinterpret_cast<uint64_t*>(b.misc + MISC_PWAIT) = now_ns();
      detail_stamp(b, MK_EV_WAIT_TOPK_END, what >> 4);  // immediate records (detail builds): here
      detail_stamp(b, MK_EV_TOPK_BEGIN, what >> 4);
    }
  }
  detail_stamp(b, MK_EV_TOPK_STEP_BEGIN, 0);  // detail builds: where top-k's time goes
  if (p.route_override) {  // forced routing: only the selected logits are read
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (ok[h] && lane() < TOPK) mysel[h] = p.route_override[(layer * T_MAX + tt[h]) * TOPK + lane()];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (SENTINEL_ROUTE) {
        if (ok[h]) myv[h] = topk_polled(raw[h], mysel[h]);  // ok[h] is the same on every lane
      } else {
        if (ok[h] && lane() < TOPK) myv[h] = ldg_cgf(p.router_logits + tt[h] * E + mysel[h]);
      }
    }
  } else {
    uint32_t key[2][TOPK_PER_LANE];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < TOPK_PER_LANE; ++i) {
        const int e = lane() + 32 * i;
        const float v =
            SENTINEL_ROUTE ? u2f(raw[h][i]) : (ok[h] && e < E ? ldg_cgf(p.router_logits + tt[h] * E + e) : 0.f);
        key[h][i] = ok[h] && e < E ? topk_key(v) : 0u;
      }
#pragma unroll 1
    for (int r = 0; r < TOPK; ++r) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t bk = 0u;
        int bi = 0;
#pragma unroll
        for (int i = 0; i < TOPK_PER_LANE; ++i)
          if (key[h][i] > bk) {  // strict: the lowest i (expert) of equal keys
            bk = key[h][i];
            bi = i;
          }
        const uint32_t m = warp_max_u32(bk);
        const uint32_t be = warp_min_u32(bk == m ? static_cast<uint32_t>(lane() + 32 * bi) : 0xffffffffu);
        if (static_cast<int>(be & 31u) == lane()) {
#pragma unroll
          for (int i = 0; i < TOPK_PER_LANE; ++i)
            if (i == static_cast<int>(be >> 5)) key[h][i] = 0u;
        }
        if (lane() == r) {
          mysel[h] = static_cast<int>(be);
          myv[h] = topk_logit(m);
        }
      }
    }
  }
  detail_stamp(b, MK_EV_TOPK_STEP_END, 0);
  detail_stamp(b, MK_EV_TOPK_STEP_BEGIN, 1);
  if constexpr (SENTINEL_ROUTE) {  // empty again for the next layer (this lane's words: read above)
    // Ordered before the next router's stores: they come after this op's counter release and the
    // layer's dependency chain (or after a launch boundary). Danger: a reset that lands after them
    // would erase fresh logits, and the next top-k would wait until the watchdog trips.
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < TOPK_PER_LANE; ++i)
        if (ok[h] && lane() + 32 * i < E)
          st_relaxed(p.router_logits + tt[h] * E + lane() + 32 * i, mb::sentinel::F32_FILL_WORD);
  }
  // softmax over the selected logits, summed in rank order (one copy of the code for both tokens:
  // selects, not indexing, so the arrays stay in registers)
MK_COLD_LOOP
  for (int h = 0; h < 2; ++h) {
    const int t = h ? tt[1] : tt[0], sel = h ? mysel[1] : mysel[0];
    const float v = h ? myv[1] : myv[0];
    if (t >= step_rows(b)) break;
    float mx = neg_inf();
#pragma unroll
    for (int r = 0; r < TOPK; ++r) mx = fmax_(mx, shfl_f(v, r));
    const float ev = fexp(v - mx);
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < TOPK; ++r) sum += shfl_f(ev, r);
    if (lane() < TOPK) {
      p.route_sel[t * TOPK + lane()] = sel;
      p.route_w[t * TOPK + lane()] = ev / sum;
      sel_s[t * TOPK + lane()] = sel;
    }
  }
  sync_compute();
  detail_stamp(b, MK_EV_TOPK_STEP_END, 1);
  detail_stamp(b, MK_EV_TOPK_STEP_BEGIN, 2);
  // Distinct experts in ascending order become slots; an entry (t, r) goes to row "number of
  // earlier tokens routed to the same expert" of its slot (a token never repeats an expert).
  // Both from bit sets (order-independent ORs, so the result is the same however threads run):
  // the expert bitmap gives slots by prefix popcount, each expert's token mask gives counts and
  // rows by popcount. No thread loops over the entries.
  const int n = step_rows(b) * TOPK;
MK_COLD_LOOP
  for (int i = tid(); i < n; i += COMPUTE_THREADS) {
    const int e = sel_s[i];
    atomic_or_smem(&bitmap[e >> 5], 1u << (e & 31));
    atomic_or_smem(&tokmask[e], 1u << (i / TOPK));
  }
  sync_compute();
  if (tid() == 0) {
    int acc = 0;
    for (int i = 0; i < (E + 31) / 32; ++i) {
      before[i] = acc;
      acc += popc(static_cast<uint32_t>(bitmap[i]));
    }
    *p.n_slots = acc;
    b.misc[MISC_NSLOTS] = acc;  // published in top-k's counter (program.cuh signal_op_end)
  }
  sync_compute();
  auto slot_of = [bitmap, before](int e) {
    return before[e >> 5] + popc(static_cast<uint32_t>(bitmap[e >> 5]) & ((1u << (e & 31)) - 1u));
  };
  if constexpr (EXPERT_PARALLEL) {  // TP's expert-parallel arrangement: this rank's slots, experts e % TP == rank
    if (tid() == 0) {
      int n = 0;
      for (int e = p.rank; e < E; e += TP)
        if ((static_cast<uint32_t>(bitmap[e >> 5]) >> (e & 31)) & 1u) p.rank_slots[1 + n++] = slot_of(e);
      p.rank_slots[0] = n;
      b.misc[MISC_NSLOTS] = n;  // the routed ops' unit count on this rank (program.cuh signal_op_end)
    }
  }
MK_COLD_LOOP
  for (int e = tid(); e < E; e += COMPUTE_THREADS) {
    const uint32_t m = static_cast<uint32_t>(tokmask[e]);
    if constexpr (UNION_EXPERTS) p.expert_slot[e] = m ? slot_of(e) : -1;
    if (!m) continue;
    const int s = slot_of(e);
    p.slot_expert[s] = e;
    p.slot_ntok[s] = popc(m);
  }
MK_COLD_LOOP
  for (int i = tid(); i < n; i += COMPUTE_THREADS) {
    const int e = sel_s[i], t = i / TOPK, s = slot_of(e);
    const int pos = popc(static_cast<uint32_t>(tokmask[e]) & ((1u << t) - 1u));
    p.slot_tok[s * 16 + pos] = t;
    p.route_slot[i] = s;
    p.route_pos[i] = pos;
  }
  detail_stamp(b, MK_EV_TOPK_STEP_END, 2);
  if constexpr (UNION_EXPERTS) union_build(b, ticket);
}

}  // namespace mk
