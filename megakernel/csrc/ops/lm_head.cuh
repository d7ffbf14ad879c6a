// lm_head: logits = rmsnorm(x, final_norm) @ lm_head^T (fp32; the norm factor applied to the fp32
// result, gemm.cuh stage_normed), plus each unit's best and second best per token
// (value desc, index asc) for the final reduction (argmax.cuh: the greedy token and the top-2).
// Unit = 16 vocabulary rows.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_lm_head(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  return produce_bf16<16, TILE_LM_HEAD_KC, D>(b, b.p->lm_head, unit, c, what);
}

MK_DEV void run_lm_head(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  auto stage = [&](int panel) {
    stage_normed(b, 0, ss_part(p, 0), tag_of(TAG_FINAL_NORM, layer, 0), panel, what);
  };  // called by the GEMM before each panel's first chunk
  gemm_stash<16>(b, gemm_bf16<16, TILE_LM_HEAD_KC, D, NORM_KP>(b, what, stage));
MK_COLD_LOOP
  for (int i = tid(); i < 16 * 16; i += COMPUTE_THREADS) {
    const int t = i / 16, n = i % 16;
    if (t < step_rows(b)) p.logits[t * V + unit * 16 + n] = gemm_sum<16>(b, t, n) * norm_factor(b, t);
  }
  if (tid() < step_rows(b)) {
    const int t = tid();
    float best = neg_inf(), second = neg_inf();
    int bi = 0x7fffffff, si = 0x7fffffff;
    const float r = norm_factor(b, t);
    for (int n = 0; n < 16; ++n) {
      const float v = gemm_sum<16>(b, t, n) * r;
      if (v > best) {  // strict: the first (lowest) index wins ties
        second = best;
        si = bi;
        best = v;
        bi = unit * 16 + n;
      } else if (v > second) {
        second = v;
        si = unit * 16 + n;
      }
    }
    p.amax_val[unit * T_MAX + t] = best;
    p.amax_idx[unit * T_MAX + t] = bi;
    p.amax_val2[unit * T_MAX + t] = second;
    p.amax_idx2[unit * T_MAX + t] = si;
  }
}

}  // namespace mk
