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
// Plan.dense_tiles: unit `unit` for each group of the run g0 leads (gemm_bf16_tiles)
MK_DEV void run_oproj_tiles(Blk& b, int layer, int unit, int g0, uint32_t what) {
  constexpr int R = TILE_OPROJ_ROWS;
  Residual<R> r[DENSE_TILES];
  tiles_each(b, g0, [&](int n) { r[n] = residual_begin<R>(b, unit, b.p->layers[layer].ffn_norm); });
  // each group's attention output in its region, OPROJ_TKP columns at a time (Plan.tile_kp)
  auto stage = [&](int panel) {
    tiles_each(b, g0, [&](int) {
      stage_plain_panel<ATT_W, OPROJ_TKP>(b, b.p->att_out, tag_of(TAG_ATT_OUT, layer, 0), panel);
    });
  };
  const Bf16Tiles acc = gemm_bf16_tiles<R, TILE_OPROJ_KC, ATT_W, OPROJ_TKP>(b, tiles_two(b, g0), what, stage);
  tiles_each(b, g0, [&](int n) {
    if (n > 0) sync_compute();  // the previous group's epilogue is done with red
    residual_end<R>(b, r[n], unit, 1, acc.t[n]);
  });
}

}  // namespace mk
