// router: logits = rmsnorm(x, ffn_norm) @ router^T, fp32. Unit = 8 experts.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_router(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  return produce_bf16<8, TILE_ROUTER_KC, D>(b, b.p->layers[layer].router, unit * 8, c, what);
}

MK_DEV void run_router(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  stage_norm<D>(b, p.x, ss_part(p, 1), p.layers[layer].ffn_norm, tag_of(TAG_FFN_NORM, layer, 0));
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  gemm_bf16<8, TILE_ROUTER_KC, D>(b, acc, what);
  gemm_stash<8>(b, acc);
  for (int i = tid(); i < 16 * 8; i += COMPUTE_THREADS) {
    const int t = i / 8, n = i % 8;
    if (t < b.T) p.router_logits[t * E + unit * 8 + n] = gemm_sum<8>(b, t, n);
  }
}

}  // namespace mk
