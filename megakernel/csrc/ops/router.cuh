// router: logits = rmsnorm(x, ffn_norm) @ router^T, fp32 (the norm factor applied to the fp32 result,
// gemm.cuh stage_normed). Unit = TILE_ROUTER_ROWS experts. Its k-chunks
// are walked last to first (gemm_bf16 REV): with a paneled operand it leaves panel 0 staged for pool.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"
#include "mb/sentinel.cuh"

namespace mk {

MK_DEV bool load_router(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  constexpr int R = TILE_ROUTER_ROWS;
  return produce_bf16<R, TILE_ROUTER_KC, D, true>(b, b.p->layers[layer].router, unit, c, what);
}

MK_DEV void router_end(Blk& b, int unit, const Bf16Acc& acc) {
  const Params& p = *b.p;
  constexpr int R = TILE_ROUTER_ROWS;
  gemm_stash<R>(b, acc);
MK_COLD_LOOP
  for (int i = tid(); i < 16 * R; i += COMPUTE_THREADS) {
    const int t = i / R, n = i % R;
    if (t >= step_rows(b)) continue;
    float* dst = p.router_logits + t * E + unit * R + n;
    // sentinel slots (topk.cuh): -0.0 means "not written yet", so a -0.0 logit is stored as +0.0
    // (top-k keys them alike); a strong store, polled by top-k's block
    const float v = gemm_sum<R>(b, t, n) * norm_factor(b, t);
    if constexpr (SENTINEL_ROUTE) st_relaxed(dst, mb::sentinel::f32_encode(f2u(v)));
    else *dst = v;
  }
}
// The normed operand's panel (the router's and the pooler's: the ffn norm)
MK_DEV void ffn_stage(Blk& b, int layer, int panel, uint32_t what) {
  stage_normed(b, 1, ss_part(*b.p, 1), tag_of(TAG_FFN_NORM, layer, 0), panel, what);
}

MK_DEV void run_router(Blk& b, int layer, int unit, uint32_t what) {
  auto stage = [&](int panel) { ffn_stage(b, layer, panel, what); };  // before each panel's first chunk
  router_end(b, unit, gemm_bf16<TILE_ROUTER_ROWS, TILE_ROUTER_KC, D, NORM_KP, true>(b, what, stage));
}

}  // namespace mk
