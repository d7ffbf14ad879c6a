// unpool (the unpooler): x += z @ unpool^T, p -> d (fp32 residual add), and for the next attention
// (or final) norm the new x's sums of squares per 8 features (gemm.cuh ss8) and bf16(x * gain)
// (xg_at). Unit = TILE_UNPOOL_ROWS features of x.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_unpool(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  constexpr int R = TILE_UNPOOL_ROWS;
  return produce_bf16<R, TILE_UNPOOL_KC, P>(b, b.p->layers[layer].unpool, unit, c, what);
}

// The gain of the norm that reads the new x next: the next layer's attention norm, or the final one
MK_DEV const uint16_t* unpool_gain(const Params& p, int layer) {
  return layer + 1 < L ? p.layers[layer + 1].attn_norm : p.final_norm;
}

// The operand: the MoE combine's pooled-space rows z
MK_DEV void unpool_stage(Blk& b, int layer) { stage_plain<P>(b, b.p->z, tag_of(TAG_Z, layer, 0)); }

MK_DEV void run_unpool(Blk& b, int layer, int unit, uint32_t what) {
  unpool_stage(b, layer);
  gemm_residual_add<TILE_UNPOOL_ROWS, TILE_UNPOOL_KC, P>(b, unit, 0, unpool_gain(*b.p, layer), what);
}

}  // namespace mk
