// moe_combine: z[t] = bf16(sum over ranks r, in order, of w[t][r] * y[slot(t,r)][row(t,r)]).
// Unit = MOE_COMBINE_COLS columns of p.
// FUSED_EXPERTS: y is bf16 of the sum of the slot's EXP2_TILES fp32 partials, in order (ypart).
#pragma once
#include "mk/block.cuh"
#include "ops/expert_gemm2.cuh"

namespace mk {

MK_DEV void run_moe_combine(Blk& b, int unit) {
  const Params& p = *b.p;
  // the step's routing (T x TOPK weights, slots, rows) read once into shared memory
  float* w_s = reinterpret_cast<float*>(b.abuf);
  int* row_s = reinterpret_cast<int*>(b.abuf + T_MAX * TOPK * 4);
  if (tid() == 0) b.misc[MISC_TAG] = -1;  // abuf reused as scratch
MK_COLD_LOOP
  for (int i = tid(); i < step_rows(b) * TOPK; i += COMPUTE_THREADS) {
    w_s[i] = ldg_cgf(p.route_w + i);
    row_s[i] = ldg_cgi(p.route_slot + i) * 16 + ldg_cgi(p.route_pos + i);
  }
  sync_compute();
  static_assert(P % MOE_COMBINE_COLS == 0 && MOE_COMBINE_COLS % 2 == 0, "whole bf16 pairs");
MK_COLD_LOOP
  for (int i = tid(); i < step_rows(b) * MOE_COMBINE_COLS; i += COMPUTE_THREADS) {
    const int t = i / MOE_COMBINE_COLS, col = unit * MOE_COMBINE_COLS + i % MOE_COMBINE_COLS;
    if constexpr (FUSED_EXPERTS) {
      float acc = 0.f;
#pragma unroll
      for (int r = 0; r < TOPK; ++r) {
        const int row = row_s[t * TOPK + r];  // slot * 16 + position
        const float* src = p.ypart + (static_cast<size_t>(row / 16) * EXP2_TILES * 16 + row % 16) * P + col;
        float v[EXP2_TILES];
#pragma unroll
        for (int j = 0; j < EXP2_TILES; ++j) v[j] = ldg_cgf(src + static_cast<size_t>(j) * 16 * P);
        float y = v[0];
#pragma unroll
        for (int j = 1; j < EXP2_TILES; ++j) y = fadd_rn(y, v[j]);
        acc = acc + w_s[t * TOPK + r] * bf2f(f2bf(y));
      }
      p.z[t * P + col] = f2bf(acc);
      continue;
    }
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
