// expert_gemm2: down projection of one routed expert (NVFP4). Unit = (slot s, N2 output features
// j*N2..), streamed in chunks of TILE_EXPERT2_KC columns. y[s][i][c] = bf16(fp32 accumulator * the expert's tensor scale).
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"
#include "mk/slot.cuh"

namespace mk {

constexpr int N2 = TILE_EXPERT2_ROWS;
constexpr int EXP2_TILES = P / N2;

MK_DEV bool load_expert2(const Blk& b, LoaderSlot& ls, int layer, int unit, unsigned& c, uint32_t what) {
  const Params& p = *b.p;
  const LayerPtrs& L = p.layers[layer];
  const int s = unit / EXP2_TILES, j = unit % EXP2_TILES;
  const int e = loader_expert(b, ls, layer, s);
  const uint8_t* codes = L.w2_codes + static_cast<size_t>(e) * P * (F / 2);
  const uint8_t* scales = L.w2_scales + static_cast<size_t>(e) * P * (F / 16);
  return produce_fp4<N2, TILE_EXPERT2_KC, F, P, 1>(b, codes, scales, [j](int) { return j * N2; }, c, what);
}

MK_DEV void run_expert2(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  const int s = unit / EXP2_TILES, j = unit % EXP2_TILES, tag = tag_of(TAG_EXP2, layer, s);
  const SlotInfo si = slot_info(b);
  const int ntok = si.ntok;
  const float ts = ldg_cgf(p.layers[layer].w2_ts + si.expert);  // waited for in the epilogue (slot.cuh)
  const uint16_t* rows = p.act + static_cast<size_t>(s) * 16 * F;
  stage_gather_perm<F>(b, rows, ntok, [](int i) { return i; }, tag);
  gemm_fp4<N2, TILE_EXPERT2_KC, F, TILE_EXPERT2_SW>(b, ntok, what);
  detail_stamp(b, MK_EV_EPILOGUE_BEGIN, 0);
  // only the slot's token rows (a slot has ~3 of its 16 at T=16): no pass over rows it lacks
MK_COLD_LOOP
  for (int i = tid(); i < ntok * N2; i += COMPUTE_THREADS) {
    const int r = i / N2, n = i % N2;
    p.yexp[(s * 16 + r) * P + j * N2 + n] = f2bf(fp4_out<N2>(b, r, n) * ts);
  }
  detail_stamp(b, MK_EV_EPILOGUE_END, 0);
}

}  // namespace mk
