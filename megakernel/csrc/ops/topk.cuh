// topk: per token the k largest router logits (ties: lower expert index first), or the forced
// experts of a synthetic routing; weights = softmax over the selected logits in rank order.
// Then the step's distinct experts in ascending order ("slots"), each slot's token list (tokens
// ascending), and per (token, rank) its slot and row in that list. One unit, one block.
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

constexpr int TOPK_PER_LANE = (E + 31) / 32;

MK_DEV void run_topk(Blk& b, int layer) {
  const Params& p = *b.p;
  int* sel_s = b.misc + MISC_SCRATCH;      // [T_MAX * TOPK]
  int* ntok_s = sel_s + T_MAX * TOPK;      // [MAX_SLOTS]
  int* bitmap = ntok_s + MAX_SLOTS;        // [E / 32]
  for (int t = warp(); t < b.T; t += WARPS) {
    float v[TOPK_PER_LANE];
    uint32_t taken = 0;
    for (int i = 0; i < TOPK_PER_LANE; ++i) {
      const int e = lane() + 32 * i;
      v[i] = e < E ? ldg_cgf(p.router_logits + t * E + e) : neg_inf();
    }
    int sel[TOPK];
    for (int r = 0; r < TOPK; ++r) {
      if (p.route_override) {
        sel[r] = p.route_override[(layer * T_MAX + t) * TOPK + r];
        continue;
      }
      float bv = neg_inf();
      int be = 0x7fffffff;
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
      sel[r] = be;
      if ((be & 31) == lane()) taken |= 1u << (be >> 5);
    }
    if (lane() == 0) {
      float lv[TOPK], mx = neg_inf(), sum = 0.f;
      for (int r = 0; r < TOPK; ++r) {
        lv[r] = ldg_cgf(p.router_logits + t * E + sel[r]);
        mx = fmax_(mx, lv[r]);
      }
      for (int r = 0; r < TOPK; ++r) {
        lv[r] = fexp(lv[r] - mx);
        sum += lv[r];
      }
      for (int r = 0; r < TOPK; ++r) {
        p.route_sel[t * TOPK + r] = sel[r];
        p.route_w[t * TOPK + r] = lv[r] / sum;
        sel_s[t * TOPK + r] = sel[r];
      }
    }
  }
  sync_compute();
  if (tid() == 0) {
    for (int i = 0; i < (E + 31) / 32; ++i) bitmap[i] = 0;
    for (int i = 0; i < b.T * TOPK; ++i) bitmap[sel_s[i] >> 5] |= 1 << (sel_s[i] & 31);
    int n = 0;
    for (int e = 0; e < E; ++e)
      if ((bitmap[e >> 5] >> (e & 31)) & 1) {
        ntok_s[n] = 0;
        p.slot_expert[n++] = e;
      }
    for (int t = 0; t < b.T; ++t)
      for (int r = 0; r < TOPK; ++r) {
        const int e = sel_s[t * TOPK + r];
        int s = 0;  // rank of e among the selected experts = number of set bits below it
        for (int i = 0; i < (e >> 5); ++i) s += popc(static_cast<uint32_t>(bitmap[i]));
        s += popc(static_cast<uint32_t>(bitmap[e >> 5]) & ((1u << (e & 31)) - 1u));
        const int pos = ntok_s[s]++;
        p.slot_tok[s * 16 + pos] = t;
        p.route_slot[t * TOPK + r] = s;
        p.route_pos[t * TOPK + r] = pos;
      }
    for (int s = 0; s < n; ++s) p.slot_ntok[s] = ntok_s[s];
    *p.n_slots = n;
  }
}

}  // namespace mk
