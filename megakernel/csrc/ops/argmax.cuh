// argmax: the greedy token of each tree position from the LM-head units' partial maxima, and the
// row's top-2 (the two best by (logit desc, index asc) over every unit's best and second best:
// draft.top2's order), which the drafter's pass hands to the verifier's tree (every build computes
// it; a plain step leaves it unread). Also clears the other parity's dependency counters, which no
// launch is using now (the previous step has finished, the next has not started).
// The rows' scans run side by side: the compute threads are split into `rows` runs of
// COMPUTE_THREADS / rows, each scanning a strided share of the V/16 units of its row, then each
// run's top-2s are merged pairwise in shared memory. Invariant: the top-2 is a selection under a
// total order (units hold disjoint indices; a sentinel (-inf, INT_MAX) never ranks before
// anything), so the merge order cannot change it: bitwise the result of a scan in unit order.
// Bound: one unit on one block, on the critical path of every step: each thread loads the partials
// of at most ceil(V/16 / (COMPUTE_THREADS / rows)) units, then log2 of its run's length merges.
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

// (v, i) ranks before (bv, bi): a larger logit, or the same logit at a lower index
MK_DEV bool ranks_before(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

struct Top2 {
  float v0, v1;
  int i0, i1;
  MK_DEV void insert(float v, int i) {
    if (ranks_before(v, i, v0, i0)) {
      v1 = v0;
      i1 = i0;
      v0 = v;
      i0 = i;
    } else if (ranks_before(v, i, v1, i1)) {
      v1 = v;
      i1 = i;
    }
  }
};

MK_DEV void run_argmax(Blk& b) {
  const Params& p = *b.p;
  const int rows = step_rows(b), run = COMPUTE_THREADS / rows, t = tid() / run, j = tid() % run;
  static_assert(COMPUTE_THREADS * sizeof(Top2) <= RED_BYTES, "a top-2 per compute thread fits the reduction buffer");
  Top2* red = reinterpret_cast<Top2*>(b.red);
  Top2 k{neg_inf(), neg_inf(), 0x7fffffff, 0x7fffffff};
  if (t < rows) {
#pragma unroll 4
    for (int u = j; u < V / 16; u += run) {
      k.insert(ldg_cgf(p.amax_val + u * T_MAX + t), ldg_cgi(p.amax_idx + u * T_MAX + t));
      k.insert(ldg_cgf(p.amax_val2 + u * T_MAX + t), ldg_cgi(p.amax_idx2 + u * T_MAX + t));
    }
  }
  red[tid()] = k;
  // a run's entries j and j + s merge into j, for s = 1, 2, 4, ... (every thread reaches each barrier)
MK_COLD_LOOP
  for (int s = 1; s < run; s *= 2) {
    sync_compute();
    if (t < rows && j % (2 * s) == 0 && j + s < run) {
      const Top2 o = red[tid() + s];
      k.insert(o.v0, o.i0);
      k.insert(o.v1, o.i1);
      red[tid()] = k;
    }
  }
  if (t < rows && j == 0) {
    p.out_tokens[t] = k.i0;
    p.top2[2 * t] = k.i0;
    p.top2[2 * t + 1] = k.i1;
  }
  if (b.wait) {
    uint32_t* other = p.counters + (b.parity ^ 1) * p.n_counters;
MK_COLD_LOOP
    for (int i = tid(); i < p.n_counters; i += COMPUTE_THREADS) other[i] = 0u;
  }
}

}  // namespace mk
