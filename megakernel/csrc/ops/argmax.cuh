// argmax: the greedy token of each tree position from the LM-head units' partial maxima, scanned
// in unit order (ties -> lowest index), and the row's top-2 (the two best by (logit desc, index
// asc) over every unit's best and second best: draft.top2's order), which the drafter's pass hands
// to the verifier's tree (every build computes it; a plain step leaves it unread). Also clears the
// other parity's dependency counters, which no launch is using now (the previous step has
// finished, the next has not started).
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

// (v, i) ranks before (bv, bi): a larger logit, or the same logit at a lower index
MK_DEV bool ranks_before(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

MK_DEV void run_argmax(Blk& b) {
  const Params& p = *b.p;
  if (tid() < step_rows(b)) {
    const int t = tid();
    float best = neg_inf(), second = neg_inf();
    int bi = 0x7fffffff, si = 0x7fffffff;
    for (int u = 0; u < V / 16; ++u) {
      const float v = ldg_cgf(p.amax_val + u * T_MAX + t);
      const int i = ldg_cgi(p.amax_idx + u * T_MAX + t);
      const float v2 = ldg_cgf(p.amax_val2 + u * T_MAX + t);
      const int i2 = ldg_cgi(p.amax_idx2 + u * T_MAX + t);
      if (ranks_before(v, i, best, bi)) {  // the unit's best leads: its second or the old best follows
        const bool own = ranks_before(v2, i2, best, bi);
        second = own ? v2 : best;
        si = own ? i2 : bi;
        best = v;
        bi = i;
      } else if (ranks_before(v, i, second, si)) {  // the unit's second ranks after its best
        second = v;
        si = i;
      }
    }
    p.out_tokens[t] = bi;
    p.top2[2 * t] = bi;
    p.top2[2 * t + 1] = si;
  }
  if (b.wait) {
    uint32_t* other = p.counters + (b.parity ^ 1) * p.n_counters;
MK_COLD_LOOP
    for (int i = tid(); i < p.n_counters; i += COMPUTE_THREADS) other[i] = 0u;
  }
}

}  // namespace mk
