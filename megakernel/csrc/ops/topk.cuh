// topk: per token the k largest router logits (ties: lower expert index first), or the forced
// experts of a synthetic routing; weights = softmax over the selected logits in rank order.
// Then the step's distinct experts in ascending order ("slots"), each slot's token list (tokens
// ascending), and per (token, rank) its slot and row in that list. One unit, one block.
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

constexpr int TOPK_PER_LANE = (E + 31) / 32;
static_assert(TOPK <= 32, "lane r holds the rank-r selection");

MK_DEV void run_topk(Blk& b, int layer) {
  const Params& p = *b.p;
  int* sel_s = b.misc + MISC_SCRATCH;      // [T_MAX * TOPK] selected expert of (t, rank)
  int* before = sel_s + T_MAX * TOPK;      // [E / 32] slots of the experts in earlier bitmap words
  int* bitmap = before + (E + 31) / 32;    // [E / 32] experts selected by any token
  int* tokmask = bitmap + (E + 31) / 32;   // [E] bit t: token t selected the expert
  if (tid() < (E + 31) / 32) bitmap[tid()] = 0;
MK_COLD_LOOP
  for (int e = tid(); e < E; e += COMPUTE_THREADS) tokmask[e] = 0;
  // A warp per token; lane r keeps the rank-r selection. The rank loop is not unrolled: top-k runs
  // once per layer on one block, from a cold instruction cache, so its code size is its cost
  // (unrolled over the ranks it was 27 KB of SASS and ~12 us of a shard8 layer).
MK_COLD_LOOP
  for (int t = warp(); t < b.T; t += WARPS) {
    float v[TOPK_PER_LANE];
    uint32_t taken = 0;
#pragma unroll
    for (int i = 0; i < TOPK_PER_LANE; ++i) {
      const int e = lane() + 32 * i;
      v[i] = e < E ? ldg_cgf(p.router_logits + t * E + e) : neg_inf();
    }
    int mysel = 0;
    float myv = 0.f;
    if (p.route_override) {
      if (lane() < TOPK) {
        mysel = p.route_override[(layer * T_MAX + t) * TOPK + lane()];
        myv = ldg_cgf(p.router_logits + t * E + mysel);
      }
    } else {
#pragma unroll 1
      for (int r = 0; r < TOPK; ++r) {
        float bv = neg_inf();
        int be = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < TOPK_PER_LANE; ++i) {
          const int e = lane() + 32 * i;
          if (e < E && !((taken >> i) & 1u) && (v[i] > bv || (v[i] == bv && e < be))) {
            bv = v[i];
            be = e;
          }
        }
        for (int m = 16; m >= 1; m >>= 1) {
          const float ov = shfl_xor(bv, m);
          const int oe = shfl_xor_i(be, m);
          if (ov > bv || (ov == bv && oe < be)) {
            bv = ov;
            be = oe;
          }
        }
        if ((be & 31) == lane()) taken |= 1u << (be >> 5);
        if (lane() == r) {
          mysel = be;
          myv = bv;
        }
      }
    }
    // softmax over the selected logits, summed in rank order
    float mx = neg_inf();
#pragma unroll
    for (int r = 0; r < TOPK; ++r) mx = fmax_(mx, shfl_f(myv, r));
    const float ev = fexp(myv - mx);
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < TOPK; ++r) sum += shfl_f(ev, r);
    if (lane() < TOPK) {
      p.route_sel[t * TOPK + lane()] = mysel;
      p.route_w[t * TOPK + lane()] = ev / sum;
      sel_s[t * TOPK + lane()] = mysel;
    }
  }
  sync_compute();
  // Distinct experts in ascending order become slots; an entry (t, r) goes to row "number of
  // earlier tokens routed to the same expert" of its slot (a token never repeats an expert).
  // Both from bit sets (order-independent ORs, so the result is the same however threads run):
  // the expert bitmap gives slots by prefix popcount, each expert's token mask gives counts and
  // rows by popcount. No thread loops over the entries.
  const int n = b.T * TOPK;
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
  }
  sync_compute();
  auto slot_of = [bitmap, before](int e) {
    return before[e >> 5] + popc(static_cast<uint32_t>(bitmap[e >> 5]) & ((1u << (e & 31)) - 1u));
  };
MK_COLD_LOOP
  for (int e = tid(); e < E; e += COMPUTE_THREADS) {
    const uint32_t m = static_cast<uint32_t>(tokmask[e]);
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
}

}  // namespace mk
