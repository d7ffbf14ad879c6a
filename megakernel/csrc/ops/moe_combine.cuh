// moe_combine: z[t] = bf16(sum over ranks r, in order, of w[t][r] * y[slot(t,r)][row(t,r)]).
// Unit = MOE_COMBINE_COLS columns of p.
#pragma once
#include "mk/block.cuh"

namespace mk {

MK_DEV void run_moe_combine(Blk& b, int unit) {
  const Params& p = *b.p;
  // the step's routing (T x TOPK weights, slots, rows) read once into shared memory
  float* w_s = reinterpret_cast<float*>(b.abuf);
  int* row_s = reinterpret_cast<int*>(b.abuf + T_MAX * TOPK * 4);
  if (tid() == 0) b.misc[MISC_TAG] = -1;  // abuf reused as scratch
MK_COLD_LOOP
  for (int i = tid(); i < b.T * TOPK; i += COMPUTE_THREADS) {
    w_s[i] = ldg_cgf(p.route_w + i);
    row_s[i] = ldg_cgi(p.route_slot + i) * 16 + ldg_cgi(p.route_pos + i);
  }
  sync_compute();
  static_assert(P % MOE_COMBINE_COLS == 0 && MOE_COMBINE_COLS % 2 == 0, "whole bf16 pairs");
MK_COLD_LOOP
  for (int i = tid(); i < b.T * MOE_COMBINE_COLS; i += COMPUTE_THREADS) {
    const int t = i / MOE_COMBINE_COLS, col = unit * MOE_COMBINE_COLS + i % MOE_COMBINE_COLS;
    uint32_t pairs[TOPK];
#pragma unroll
    for (int r = 0; r < TOPK; ++r) pairs[r] = ldg_cg(p.yexp + row_s[t * TOPK + r] * P + (col & ~1));
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < TOPK; ++r)
      acc = acc + w_s[t * TOPK + r] * bf2f(static_cast<uint16_t>((col & 1) ? pairs[r] >> 16 : pairs[r] & 0xffffu));
    p.z[t * P + col] = f2bf(acc);
  }
}

}  // namespace mk
