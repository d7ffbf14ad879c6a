// expert_gemm1: gate/up projection of one routed expert with NVFP4 dequantisation and the gated
// activation. Unit = (slot s, H1 intermediate features j*H1..): its 2*H1 weight rows are gate rows
// j*H1.. and the matching up rows F + j*H1.. Only the slot's routed tokens (<= 16) are staged;
// act[s][i][f] = bf16(silu(g) * u) with g, u = fp32 accumulators * the expert's tensor scale.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"
#include "mk/slot.cuh"

namespace mk {

constexpr int H1 = TILE_EXPERT1_ROWS / 2;  // gate rows (and up rows) per unit
constexpr int EXP1_TILES = F_SH / H1;  // a slot's units: of the rank's gate rows (F_SH = F without TP)
constexpr int KEEP_UNIT = 16 * (2 * H1 + ROW_PAD);  // a kept unit's bytes (plan.keep_unit_bytes)
constexpr int KEEP_SLOTS = KEEP_UNITS > 0 ? KEEP_UNITS : 1;  // unit u is kept in buffer u % KEEP_SLOTS
static_assert(KEEP_UNITS == 0 || KEEP_UNIT * KEEP_UNITS == KEEP_BYTES, "plan.keep_bytes");
static_assert(F % H1 == 0 && H1 % 16 == 0, "a 16-row tile holds gate rows or up rows, never both");

// Expert e's gate/up weights in the kernel's copy, and the runs of unit j's rows in a column block:
// run 0 its gate rows j*H1.., run 1 the matching up rows F + j*H1..
MK_DEV const uint8_t* expert1_codes(const LayerPtrs& L, int e) { return L.w1_codes + static_cast<size_t>(e) * (2 * F) * (P / 2); }
MK_DEV const uint8_t* expert1_scales(const LayerPtrs& L, int e) { return L.w1_scales + static_cast<size_t>(e) * (2 * F) * (P / 16); }

MK_DEV bool load_expert1(const Blk& b, LoaderSlot& ls, int layer, int unit, unsigned& c, uint32_t what) {
  const LayerPtrs& L = b.p->layers[layer];
  const int s = unit / EXP1_TILES, j = unit % EXP1_TILES;
  const int e = loader_expert(b, ls, layer, s);
  auto run0 = [j](int r) { return r * F + j * H1; };
  return produce_fp4<TILE_EXPERT1_ROWS, TILE_EXPERT1_KC, P, 2 * F, 2>(b, expert1_codes(L, e), expert1_scales(L, e), run0,
                                                                      c, what);
}

MK_DEV void run_expert1(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  const int s = unit / EXP1_TILES, j = unit % EXP1_TILES, tag = tag_of(TAG_EXP1, layer, s);
  const SlotInfo si = slot_info(b);
  const int ntok = si.ntok;
  const float ts = ldg_cgf(p.layers[layer].w1_ts + si.expert);  // waited for in the epilogue (slot.cuh)
  stage_gather_rows<P>(b, p.pooled, ntok, tag);  // the slot's tokens: MISC_ROWS (slot_fetch)
  gemm_fp4<TILE_EXPERT1_ROWS, TILE_EXPERT1_KC, P, TILE_EXPERT1_SW>(b, ntok, what);
  detail_stamp(b, MK_EV_EPILOGUE_BEGIN, 0);
  // only the slot's token rows (a slot has ~3 of its 16 at T=16): no pass over rows it lacks
MK_COLD_LOOP
  for (int i = tid(); i < ntok * H1; i += COMPUTE_THREADS) {
    const int r = i / H1, f = i % H1;
    const float g = fp4_out<TILE_EXPERT1_ROWS>(b, r, f) * ts;
    const float u = fp4_out<TILE_EXPERT1_ROWS>(b, r, H1 + f) * ts;
    const float silu = g * (1.f / (1.f + fexp(-g)));
    const uint16_t a = f2bf(silu * u);
    p.act[(s * 16 + r) * F + j * H1 + f] = a;
    if constexpr (KEEP_UNITS > 0) {  // fused: also as the down projection stages it (gemm.cuh stage_rows PERM)
      unsigned char* row = b.keep + (unit % KEEP_SLOTS) * KEEP_UNIT + r * a_stride<H1>();
      const int w = f % 4, half = (f % 8) / 4;  // value e = f % 8 of its 8 goes to pair (e % 4, e % 4 + 4)
      *reinterpret_cast<uint16_t*>(row + 64 * (f / 32) + 4 * (4 * w + (f / 8) % 4) + 2 * half) =
          f2bf(bf2f(a) * 128.f);  // the staged operand's exact 2^7 (FP4_ACT_SCALE_BF2)
    }
  }
  if constexpr (KEEP_UNITS > 0)
    if (tid() == 0) b.misc[MISC_KEEP + unit % KEEP_SLOTS] = tag_of(TAG_EXP2, layer, unit);
  detail_stamp(b, MK_EV_EPILOGUE_END, 0);
}

}  // namespace mk
