// oproj: x += att_out @ wo^T (fp32 residual add), and for the ffn norm the new x's sums of squares
// per 8 features (gemm.cuh ss8) and bf16(x * ffn_norm) (xg_at). Unit = TILE_OPROJ_ROWS rows of wo
// (features of x).
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_oproj(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  constexpr int R = TILE_OPROJ_ROWS;
  return produce_bf16<R, TILE_OPROJ_KC, ATT_W>(b, b.p->layers[layer].wo, unit, c, what);
}

// The operand: the attention's output rows
MK_DEV void oproj_stage(Blk& b, int layer) { stage_plain<ATT_W>(b, b.p->att_out, tag_of(TAG_ATT_OUT, layer, 0)); }

MK_DEV void run_oproj(Blk& b, int layer, int unit, uint32_t what) {
  oproj_stage(b, layer);
  gemm_residual_add<TILE_OPROJ_ROWS, TILE_OPROJ_KC, ATT_W>(b, unit, 1, b.p->layers[layer].ffn_norm, what);
}

}  // namespace mk
