// expert_gemm2: down projection of one routed expert (NVFP4). Unit = (slot s, N2 output features
// j*N2..), streamed in chunks of TILE_EXPERT2_KC columns. y[s][i][c] = bf16(fp32 accumulator * the expert's tensor scale).
// FUSED_EXPERTS (Plan.fused_experts): unit (s, j) is instead the K-part of gate/up unit (s, j), its
// H1 columns of K = F and all P rows in chunks of N2 rows, run by the block that ran that gate/up
// unit (program.py DEP_LOCAL: same contiguous assignment, same unit count), so it waits for no
// other block; ypart[s][j][i][c] = fp32 accumulator * tensor scale, summed over j by moe_combine.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"
#include "mk/slot.cuh"
#include "ops/expert_gemm1.cuh"

namespace mk {

constexpr int N2 = TILE_EXPERT2_ROWS;
constexpr int EXP2_TILES = FUSED_EXPERTS ? EXP1_TILES : P_SH / N2;  // of the rank's rows (P_SH = P without TP)
static_assert(!FUSED_EXPERTS || (TILE_EXPERT2_KC == H1 && TILE_EXPERT2_K == H1 * (F / H1) && P % N2 == 0),
              "fused: a chunk is N2 rows of one gate/up unit's H1 columns (plan._fused_down_tile)");

MK_DEV bool load_expert2(const Blk& b, LoaderSlot& ls, int layer, int unit, unsigned& c, uint32_t what) {
  const Params& p = *b.p;
  const LayerPtrs& L = p.layers[layer];
  const int s = unit / EXP2_TILES, j = unit % EXP2_TILES;
  const int e = loader_expert(b, ls, layer, s);
  const uint8_t* codes = L.w2_codes + static_cast<size_t>(e) * P * (F / 2);
  const uint8_t* scales = L.w2_scales + static_cast<size_t>(e) * P * (F / 16);
  if constexpr (FUSED_EXPERTS) {
    // the kernel's copy is [F/H1][P][H1/2]: chunk ch is rows ch*N2.. of column block j, one run,
    // so the walk over "K" below is a walk over P/N2 row blocks starting at row j*P of the copy
    return produce_fp4<N2, TILE_EXPERT2_KC, TILE_EXPERT2_KC * (P / N2), N2, 1>(
        b, codes, scales, [j](int) { return j * P; }, c, what);
  }
  return produce_fp4<N2, TILE_EXPERT2_KC, F, P, 1>(b, codes, scales, [j](int) { return j * N2; }, c, what);
}

// A template so that only the build's path is instantiated (the other's static checks do not
// hold for its tile: a fused chunk has more rows than gemm_fp4 takes).
template <bool FUSED = FUSED_EXPERTS>
MK_DEV void run_expert2(Blk& b, int layer, int unit, uint32_t what) {
  constexpr int R = FUSED ? 16 : N2;  // the split path's rows (dependent, so not instantiated when fused)
  const Params& p = *b.p;
  const int s = unit / EXP2_TILES, j = unit % EXP2_TILES, tag = tag_of(TAG_EXP2, layer, s);
  const SlotInfo si = slot_info(b);
  const int ntok = si.ntok;
  const float ts = ldg_cgf(p.layers[layer].w2_ts + si.expert);  // waited for in the epilogue (slot.cuh)
  if constexpr (FUSED) {
    // this K-part's activations, from this block's gate/up unit of the same index (program
    // order, barriers): kept in shared memory, or else staged from act
    const bool kept = KEEP_UNITS > 0 && b.misc[MISC_KEEP + unit % KEEP_SLOTS] == tag_of(TAG_EXP2, layer, unit);
    const unsigned char* a = b.abuf;
    if (kept) {
      a = b.keep + (unit % KEEP_SLOTS) * KEEP_UNIT;
    } else {
      stage_rows<H1, true>(b, ntok, [&](int r) { return p.act + static_cast<size_t>(s * 16 + r) * F + j * H1; });
      if (tid() == 0) b.misc[MISC_TAG] = -1;  // abuf holds no tagged operand now
    }
    if constexpr (UNION_EXPERTS) {
      // each of this thread's tokens (2t, 2t + 1, 8 + 2t, 9 + 2t) to its own group's slot and
      // position in the stacked ypart (ops/topk.cuh union_build): the partial its MoE combine reads
      int dofs[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int tok = 2 * (lane() & 3) + (k & 1) + 8 * (k >> 1);
        const int d = tok < ntok ? ldg_cgi(p.u_dst + s * 16 + tok) : 0;
        dofs[k] = ((d / 16) * EXP2_TILES + j) * 16 + d % 16;
      }
      gemm_fp4_down<N2, H1, TILE_EXPERT2_SW, P / N2>(
          b, a, ntok, ts, [&](int tok) { return p.ypart + static_cast<size_t>(dofs[(tok & 1) + 2 * (tok >> 3)]) * P; },
          what);
    } else {
      float* out = p.ypart + static_cast<size_t>(s * EXP2_TILES + j) * 16 * P;
      gemm_fp4_down<N2, H1, TILE_EXPERT2_SW, P / N2>(
          b, a, ntok, ts, [out](int tok) { return out + static_cast<size_t>(tok) * P; }, what);
    }
  } else {
    const uint16_t* rows = p.act + static_cast<size_t>(s) * 16 * F;
    if constexpr (UNION_EXPERTS) {
      // MISC_ROWS holds the slot's output rows (slot_fetch), so the rows are staged in place
      if (b.misc[MISC_TAG] != tag) {
        stage_rows<F, true>(b, ntok, [rows](int r) { return rows + static_cast<size_t>(r) * F; });
        if (tid() == 0) b.misc[MISC_TAG] = tag;
      }
    } else {
      stage_gather_perm<F>(b, rows, ntok, [](int i) { return i; }, tag);
    }
    gemm_fp4<R, TILE_EXPERT2_KC, F, TILE_EXPERT2_SW>(b, ntok, what);
    detail_stamp(b, MK_EV_EPILOGUE_BEGIN, 0);
    // only the slot's token rows (a slot has ~3 of its 16 at T=16): no pass over rows it lacks
MK_COLD_LOOP
    for (int i = tid(); i < ntok * R; i += COMPUTE_THREADS) {
      const int r = i / R, n = i % R;
      // union: each token's row of its own group's slot, in the stacked yexp (ops/topk.cuh union_build)
      const int row = UNION_EXPERTS ? b.misc[MISC_ROWS + r] : s * 16 + r;
      p.yexp[static_cast<size_t>(row) * P + j * R + n] = f2bf(fp4_out<R>(b, r, n) * ts);
    }
    detail_stamp(b, MK_EV_EPILOGUE_END, 0);
  }
}

}  // namespace mk
