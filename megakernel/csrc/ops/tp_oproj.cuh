// Tensor parallelism's attention output (Plan.tp_ranks): oproj K-sharded, then the all-reduce.
//   oproj (TP)   unit (g, tile) of this rank's OPROJ_GR K groups: the fp32 partial of the features
//                tile * R .. over group g's columns of the rank's attention output, pushed into
//                every rank's "ar" slots (mk/tp.cuh) at group rank * OPROJ_GR + g.
//   attn_reduce  unit = R features: x += the TP_GROUPS partials summed in group order, polled from
//                this rank's own slots, which it resets; then, as oproj does without TP, the new
//                x's sums of squares per 8 features and bf16(x * ffn_norm) for the ffn norm.
// The all-reduce's order, fixed: oproj's K (the model's attention width) is cut into TP_GROUPS
// groups (the most ranks the model allows, plan.max_tp_ranks); group G is the same heads at every
// R, whichever rank holds them, and its partial the same GEMM (tile, chunks, warp order). Every
// rank adds the partials in the order G = 0, 1, ... onto the same x, so x has the same bits on
// every rank and at every R, R = 1 included (its one rank computes every group).
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"
#include "mk/tp.cuh"

namespace mk {

constexpr int OPROJ_GR = TP ? TP_GROUPS / TP : 1;  // K groups per rank
constexpr int K_G = TILE_OPROJ_K;                 // columns of a group (plan: attn_width / tp_groups)
constexpr int OPROJ_TILES = D / TILE_OPROJ_ROWS;
static_assert(!TP || (TP_GROUPS % TP == 0 && OPROJ_GR * K_G == ATT_W), "a rank's attention output is whole K groups");

// The rank's wo in the kernel's copy: its groups stacked ([OPROJ_GR][D][K_G] as one [OPROJ_GR * D,
// K_G] matrix, tiled; runtime), so unit (g, tile) = g * OPROJ_TILES + tile is tile `unit` of it.
MK_DEV bool load_oproj_tp(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  return produce_bf16<TILE_OPROJ_ROWS, TILE_OPROJ_KC, K_G>(b, b.p->layers[layer].wo, unit, c, what);
}

MK_DEV void run_oproj_tp(Blk& b, int layer, int unit, uint32_t what) {
  constexpr int R = TILE_OPROJ_ROWS;
  const Params& p = *b.p;
  const int gl = unit / OPROJ_TILES, tile = unit % OPROJ_TILES, g = p.rank * OPROJ_GR + gl;
  const int tag = tag_of(TAG_ATT_OUT, layer, gl);
  if (b.misc[MISC_TAG] != tag) {  // the group's columns of the attention's output rows
    const uint16_t* src = p.att_out + gl * K_G;
    stage_rows<K_G, false>(b, step_rows(b), [src](int r) { return src + r * ATT_W; });
    if (tid() == 0) b.misc[MISC_TAG] = tag;
  }
  gemm_stash<R>(b, gemm_bf16<R, TILE_OPROJ_KC, K_G>(b, what));
  const int cp = recv_copy(b, layer);
MK_COLD_LOOP
  for (int o = tid(); o < step_rows(b) * R; o += COMPUTE_THREADS) {
    const int t = o / R, n = o % R;
    const uint32_t v = f32_slot(gemm_sum<R>(b, t, n));
    for (int d = 0; d < TP; ++d) tp_store(ar_slot(peer_recv(p, d), cp, g, t, tile * R + n), v);
  }
}

MK_DEV void run_attn_reduce(Blk& b, int layer, int unit, uint32_t what) {
  constexpr int R = TILE_OPROJ_ROWS, NO = Residual<R>::NO;
  const Params& p = *b.p;
  const int n = tid() % R;
  const Residual<R> r = residual_begin<R>(b, unit, p.layers[layer].ffn_norm);
  const int cp = recv_copy(b, layer);
  xwait_begin(b, 0);
  float sum[NO];
#pragma unroll
  for (int j = 0; j < NO; ++j) {
    const int o = tid() + COMPUTE_THREADS * j, t = o / R;
    sum[j] = 0.f;
    if (o >= 16 * R || t >= step_rows(b)) continue;
    float* slot[TP_GROUPS];
    uint32_t v[TP_GROUPS];
#pragma unroll
    for (int g = 0; g < TP_GROUPS; ++g) slot[g] = ar_slot(p.recv, cp, g, t, unit * R + n);
    // every group's word in flight at once, re-read until none is empty
    for (PollClock pc;;) {
      int miss = -1;
#pragma unroll
      for (int g = 0; g < TP_GROUPS; ++g) {
        v[g] = tp_load(slot[g]);
        if (v[g] == F32_EMPTY) miss = g;
      }
      if (miss < 0) break;
      if (!poll_again(p, pc, what_x(what, WHAT_AR, miss / OPROJ_GR, miss), slot[miss], F32_EMPTY, v[miss])) {
        b.failed = true;  // garbage from here; the step is reported
        break;
      }
    }
    float s = u2f(v[0]);
#pragma unroll
    for (int g = 1; g < TP_GROUPS; ++g) s = fadd_rn(s, u2f(v[g]));
    sum[j] = s;
#pragma unroll
    for (int g = 0; g < TP_GROUPS; ++g) tp_store(slot[g], F32_EMPTY);  // this thread alone read them
  }
  xwait_end(b, 0);
  residual_store<R>(b, p, r, unit, 1, n, [&sum](int j, int, int) { return sum[j]; });
  sync_compute();  // every reset of the unit, then their release (mk/tp.cuh)
  if (tid() == 0) reuse_fence();
}

}  // namespace mk
