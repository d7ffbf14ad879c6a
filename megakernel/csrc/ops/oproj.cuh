// oproj: x += att_out @ wo^T (fp32 residual add). Unit = 8 rows of wo (8 features of x).
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_oproj(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  return produce_bf16<8, TILE_OPROJ_KC, ATT_W>(b, b.p->layers[layer].wo, unit * 8, c, what);
}

MK_DEV void run_oproj(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  stage_plain<ATT_W>(b, p.att_out, tag_of(TAG_ATT_OUT, layer, 0));
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  gemm_bf16<8, TILE_OPROJ_KC, ATT_W>(b, acc, what);
  gemm_stash<8>(b, acc);
  for (int i = tid(); i < 16 * 8; i += COMPUTE_THREADS) {
    const int t = i / 8, n = i % 8;
    if (t < b.T) p.x[t * D + unit * 8 + n] += gemm_sum<8>(b, t, n);
  }
}

}  // namespace mk
