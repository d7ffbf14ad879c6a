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
  int* sel_s = b.misc + MISC_SCRATCH;      // [T_MAX * TOPK] selected expert of (t, rank)
  int* before = sel_s + T_MAX * TOPK;      // [E / 32] slots of the experts in earlier bitmap words
  int* bitmap = before + (E + 31) / 32;    // [E / 32] experts selected by any token
  int* tokmask = bitmap + (E + 31) / 32;   // [E] bit t: token t selected the expert
  if (tid() < (E + 31) / 32) bitmap[tid()] = 0;
  for (int e = tid(); e < E; e += COMPUTE_THREADS) tokmask[e] = 0;
  for (int t = warp(); t < b.T; t += WARPS) {  // a warp per token: selection and weights
    float v[TOPK_PER_LANE];
    uint32_t taken = 0;
#pragma unroll
    for (int i = 0; i < TOPK_PER_LANE; ++i) {
      const int e = lane() + 32 * i;
      v[i] = e < E ? ldg_cgf(p.router_logits + t * E + e) : neg_inf();
    }
    int sel[TOPK];
    float selv[TOPK];
#pragma unroll
    for (int r = 0; r < TOPK; ++r) {
      int be;
      float bv;
      if (p.route_override) {
        be = p.route_override[(layer * T_MAX + t) * TOPK + r];
        bv = ldg_cgf(p.router_logits + t * E + be);
      } else {
        bv = neg_inf();
        be = 0x7fffffff;
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
      }
      sel[r] = be;
      selv[r] = bv;
    }
    if (lane() == 0) {  // softmax over the selected logits, in rank order
      float mx = neg_inf(), sum = 0.f;
#pragma unroll
      for (int r = 0; r < TOPK; ++r) mx = fmax_(mx, selv[r]);
#pragma unroll
      for (int r = 0; r < TOPK; ++r) {
        selv[r] = fexp(selv[r] - mx);
        sum += selv[r];
      }
#pragma unroll
      for (int r = 0; r < TOPK; ++r) {
        p.route_sel[t * TOPK + r] = sel[r];
        p.route_w[t * TOPK + r] = selv[r] / sum;
        sel_s[t * TOPK + r] = sel[r];
      }
    }
  }
  sync_compute();
  // Distinct experts in ascending order become slots; an entry (t, r) goes to row "number of
  // earlier tokens routed to the same expert" of its slot (a token never repeats an expert).
  // Both from bit sets (order-independent ORs, so the result is the same however threads run):
  // the expert bitmap gives slots by prefix popcount, each expert's token mask gives counts and
  // rows by popcount. No thread loops over the entries.
  const int n = b.T * TOPK;
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
  for (int e = tid(); e < E; e += COMPUTE_THREADS) {
    const uint32_t m = static_cast<uint32_t>(tokmask[e]);
    if (!m) continue;
    const int s = slot_of(e);
    p.slot_expert[s] = e;
    p.slot_ntok[s] = popc(m);
  }
  for (int i = tid(); i < n; i += COMPUTE_THREADS) {
    const int e = sel_s[i], t = i / TOPK, s = slot_of(e);
    const int pos = popc(static_cast<uint32_t>(tokmask[e]) & ((1u << t) - 1u));
    p.slot_tok[s * 16 + pos] = t;
    p.route_slot[i] = s;
    p.route_pos[i] = pos;
  }
}

}  // namespace mk
