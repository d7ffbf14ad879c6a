// argmax: the greedy token of each tree position from the LM-head units' partial maxima, scanned
// in unit order (ties -> lowest index). Also clears the other parity's dependency counters,
// which no launch is using now (the previous step has finished, the next has not started).
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV void run_argmax(Blk& b) {
  const Params& p = *b.p;
  if (tid() < step_rows(b)) {
    const int t = tid();
    float best = neg_inf();
    int bi = 0x7fffffff;
    for (int u = 0; u < V / 16; ++u) {
      const float v = ldg_cgf(p.amax_val + u * T_MAX + t);
      const int i = ldg_cgi(p.amax_idx + u * T_MAX + t);
      if (v > best || (v == best && i < bi)) {
        best = v;
        bi = i;
      }
    }
    p.out_tokens[t] = bi;
  }
  if (b.wait) {
    uint32_t* other = p.counters + (b.parity ^ 1) * p.n_counters;
MK_COLD_LOOP
    for (int i = tid(); i < p.n_counters; i += COMPUTE_THREADS) other[i] = 0u;
  }
}

}  // namespace mk
