// Tensor parallelism's experts (Plan.tp_ranks): both expert GEMMs sharded on N, each followed by
// a bf16 all-gather through sentinel slots (mk/tp.cuh; the study gathers GEMM 1's activations in
// fp4, these are bf16).
//   expert1 (TP)  unit (slot s, j): gate rows j*H1.. and the matching up rows of the rank's share
//                 (F_SH of each, from gate row col0 = rank * F_SH of the expert), as expert_gemm1.cuh;
//                 act = bf16(silu(g) * u) pushed into every rank's "act" slots at columns col0 + j*H1..
//   expert2 (TP)  unit (slot s, j): output rows j*N2.. of the rank's share (P_SH rows, from row
//                 rank * P_SH) over all of K = F: polls the slot's gathered activations in its own
//                 "act" slots, then as expert_gemm2.cuh; y pushed into every rank's "y" slots
//   moe_combine   as ops/moe_combine.cuh, its y polled from its own "y" slots, which it resets, and
//   (TP)          its share of the layer's "act" slots reset (every expert2 unit of this rank that
//                 reads them is done: its dependency on expert2)
// Every unit computes what the unit of the same rows computes without TP (same tiles at every R:
// plan.make_plan), and the gathers move bits unchanged (the slots' encoding aside, which every TP
// build applies), so every R gives the same bits.
// Plan.expert_parallel: a slot's units all run on the rank that owns its expert (expert e on rank
// e % TP, its whole rows: F_SH = F, P_SH = P), over the rank's own slots (top-k's rank_slots);
// the same units, the same gathers, the same bits.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"
#include "mk/slot.cuh"
#include "mk/tp.cuh"
#include "ops/expert_gemm2.cuh"

namespace mk {

// The rank's bank holds experts E / TP (expert_parallel: expert e at e / TP) or all E, F_SH gate
// and F_SH up rows each (N-sharded: the rank's rows), P_SH down-projection rows.
MK_DEV int bank_expert(int e) { return EXPERT_PARALLEL ? e / TP : e; }
// the first gathered column a unit's rows give: gate/up (act) and the down projection (y)
MK_DEV int act_col0(const Params& p) { return EXPERT_PARALLEL ? 0 : p.rank * F_SH; }
MK_DEV int y_col0(const Params& p) { return EXPERT_PARALLEL ? 0 : p.rank * P_SH; }
// the rank that pushes column c of a gathered row of expert e (a collective wait's message)
MK_DEV int act_owner(int e, int c) { return EXPERT_PARALLEL ? e % TP : c / F_SH; }
MK_DEV int y_owner(int e, int c) { return EXPERT_PARALLEL ? e % TP : c / P_SH; }

MK_DEV bool load_expert1_tp(const Blk& b, LoaderSlot& ls, int layer, int unit, unsigned& c, uint32_t what) {
  const LayerPtrs& L = b.p->layers[layer];
  const int s = unit_slot(*b.p, unit / EXP1_TILES), j = unit % EXP1_TILES;
  const int e = bank_expert(loader_expert(b, ls, layer, s));
  auto run0 = [j](int r) { return r * F_SH + j * H1; };
  return produce_fp4<TILE_EXPERT1_ROWS, TILE_EXPERT1_KC, P, 2 * F_SH, 2>(
      b, L.w1_codes + static_cast<size_t>(e) * (2 * F_SH) * (P / 2), L.w1_scales + static_cast<size_t>(e) * (2 * F_SH) * (P / 16),
      run0, c, what);
}

MK_DEV void run_expert1_tp(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  const int s = unit_slot(p, unit / EXP1_TILES), j = unit % EXP1_TILES, tag = tag_of(TAG_EXP1, layer, s);
  const SlotInfo si = slot_info(b);
  const int ntok = si.ntok;
  const float ts = ldg_cgf(p.layers[layer].w1_ts + bank_expert(si.expert));  // waited for in the epilogue (slot.cuh)
  stage_gather_rows<P>(b, p.pooled, ntok, tag);
  gemm_fp4<TILE_EXPERT1_ROWS, TILE_EXPERT1_KC, P, TILE_EXPERT1_SW>(b, ntok, what);
  detail_stamp(b, MK_EV_EPILOGUE_BEGIN, 0);
  const int cp = recv_copy(b, layer), c0 = act_col0(p) + j * H1;
  static_assert(H1 % 2 == 0, "the gather moves bf16 pairs");
MK_COLD_LOOP
  for (int i = tid(); i < ntok * (H1 / 2); i += COMPUTE_THREADS) {
    const int r = i / (H1 / 2), f = 2 * (i % (H1 / 2));
    float a[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float g = fp4_out<TILE_EXPERT1_ROWS>(b, r, f + h) * ts;
      const float u = fp4_out<TILE_EXPERT1_ROWS>(b, r, H1 + f + h) * ts;
      a[h] = (g * (1.f / (1.f + fexp(-g)))) * u;  // as expert_gemm1.cuh: silu(g) * u, one rounding to bf16
    }
    const uint32_t v = bf16x2_slot(pack_bf2(a[0], a[1]));
    for (int d = 0; d < TP; ++d) tp_store(act_slot(peer_recv(p, d), cp, s, r, c0 + f), v);
  }
  detail_stamp(b, MK_EV_EPILOGUE_END, 0);
}

MK_DEV bool load_expert2_tp(const Blk& b, LoaderSlot& ls, int layer, int unit, unsigned& c, uint32_t what) {
  const LayerPtrs& L = b.p->layers[layer];
  const int s = unit_slot(*b.p, unit / EXP2_TILES), j = unit % EXP2_TILES;
  const int e = bank_expert(loader_expert(b, ls, layer, s));
  return produce_fp4<N2, TILE_EXPERT2_KC, F, P_SH, 1>(b, L.w2_codes + static_cast<size_t>(e) * P_SH * (F / 2),
                                                     L.w2_scales + static_cast<size_t>(e) * P_SH * (F / 16),
                                                     [j](int) { return j * N2; }, c, what);
}

// The slot's gathered activations, rows < ntok of all F columns, polled by each thread for the very
// 16-byte pieces stage_rows<F, true> then loads on that thread (gemm.cuh), so that its loads read
// what its poll saw (one thread's reads of one address stay in order).
MK_DEV void poll_act(Blk& b, const uint16_t* rows, int ntok, int expert, int slot, uint32_t what) {
  constexpr int K8 = F / 8, RPR = COMPUTE_THREADS / K8, NT = (16 * K8 + COMPUTE_THREADS - 1) / COMPUTE_THREADS;
  const int r0 = tid() / K8, k8 = tid() % K8;
  const Params& p = *b.p;
  xwait_begin(b, 1);
  for (PollClock pc;;) {
    const uint32_t* miss = nullptr;
    uint32_t seen = 0;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int r = r0 + RPR * n;
      if (r >= ntok) break;
      const uint32_t* w = reinterpret_cast<const uint32_t*>(rows + static_cast<size_t>(r) * F + 8 * k8);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t v = tp_load(w + q);
        if (!bf16x2_ready(v)) miss = w + q, seen = v;
      }
    }
    if (!miss) break;
    if (!poll_again(p, pc, what_x(what, WHAT_GATHER_ACT, act_owner(expert, 8 * k8), slot), miss, BF16X2_EMPTY, seen)) {
      b.failed = true;
      break;
    }
  }
  xwait_end(b, 1);
}

MK_DEV void run_expert2_tp(Blk& b, int layer, int unit, uint32_t what) {
  // the split down projection's rows (a build without TP may have the fused one's, which
  // gemm_fp4 does not take: this code is then never used, but compiled)
  constexpr int R = TP ? N2 : 16;
  const Params& p = *b.p;
  const int s = unit_slot(p, unit / EXP2_TILES), j = unit % EXP2_TILES, tag = tag_of(TAG_EXP2, layer, s);
  const SlotInfo si = slot_info(b);
  const int ntok = si.ntok;
  const float ts = ldg_cgf(p.layers[layer].w2_ts + bank_expert(si.expert));
  const int cp = recv_copy(b, layer);
  const uint16_t* rows = act_slot(p.recv, cp, s, 0, 0);
  if (b.misc[MISC_TAG] != tag) poll_act(b, rows, ntok, si.expert, s, what);  // staged already: polled then
  stage_gather_perm<F>(b, rows, ntok, [](int i) { return i; }, tag);
  gemm_fp4<R, TILE_EXPERT2_KC, F, TILE_EXPERT2_SW>(b, ntok, what);
  detail_stamp(b, MK_EV_EPILOGUE_BEGIN, 0);
  const int c0 = y_col0(p) + j * R;
  static_assert(R % 2 == 0, "the gather moves bf16 pairs");
MK_COLD_LOOP
  for (int i = tid(); i < ntok * (R / 2); i += COMPUTE_THREADS) {
    const int r = i / (R / 2), n = 2 * (i % (R / 2));
    const uint32_t v = bf16x2_slot(pack_bf2(fp4_out<R>(b, r, n) * ts, fp4_out<R>(b, r, n + 1) * ts));
    for (int d = 0; d < TP; ++d) tp_store(y_slot(peer_recv(p, d), cp, s, r, c0 + n), v);
  }
  detail_stamp(b, MK_EV_EPILOGUE_END, 0);
}

MK_DEV void run_moe_combine_tp(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  const int cp = recv_copy(b, layer);
  float* w_s = reinterpret_cast<float*>(b.abuf);
  int* row_s = reinterpret_cast<int*>(b.abuf + T_MAX * TOPK * 4);
  int* exp_s = row_s + T_MAX * TOPK;  // the expert of each (token, rank): a wait's message
  if (tid() == 0) b.misc[MISC_TAG] = -1;  // abuf reused as scratch
MK_COLD_LOOP
  for (int i = tid(); i < step_rows(b) * TOPK; i += COMPUTE_THREADS) {
    w_s[i] = ldg_cgf(p.route_w + i);
    row_s[i] = ldg_cgi(p.route_slot + i) * 16 + ldg_cgi(p.route_pos + i);
    exp_s[i] = ldg_cgi(p.route_sel + i);
  }
  sync_compute();
  static_assert(P % MOE_COMBINE_COLS == 0 && MOE_COMBINE_COLS % 2 == 0, "whole bf16 pairs");
  static_assert(T_MAX * MOE_COMBINE_COLS <= COMPUTE_THREADS, "one output per thread");
  const int t = tid() / MOE_COMBINE_COLS, col = unit * MOE_COMBINE_COLS + tid() % MOE_COMBINE_COLS;
  const bool mine = t < step_rows(b);
  uint32_t pairs[TOPK];
  uint32_t* slot[TOPK];
  xwait_begin(b, 2);
  if (mine) {
#pragma unroll
    for (int r = 0; r < TOPK; ++r) {
      const int row = row_s[t * TOPK + r];
      slot[r] = reinterpret_cast<uint32_t*>(y_slot(p.recv, cp, row / 16, row % 16, col & ~1));
    }
    for (PollClock pc;;) {
      int miss = -1;
#pragma unroll
      for (int r = 0; r < TOPK; ++r) {
        pairs[r] = tp_load(slot[r]);
        if (!bf16x2_ready(pairs[r])) miss = r;
      }
      if (miss < 0) break;
      const int e = exp_s[t * TOPK + miss];
      if (!poll_again(p, pc, what_x(what, WHAT_GATHER_Y, y_owner(e, col), row_s[t * TOPK + miss] / 16), slot[miss],
                      BF16X2_EMPTY, pairs[miss])) {
        b.failed = true;
        break;
      }
    }
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < TOPK; ++r)
      acc = acc + w_s[t * TOPK + r] * bf2f(static_cast<uint16_t>((col & 1) ? pairs[r] >> 16 : pairs[r] & 0xffffu));
    p.z[t * P + col] = f2bf(acc);  // as ops/moe_combine.cuh
  }
  xwait_end(b, 2);
  sync_compute();  // both threads of a pair have polled it
  if (mine && (col & 1) == 0) {
#pragma unroll
    for (int r = 0; r < TOPK; ++r) tp_store(slot[r], BF16X2_EMPTY);
  }
  // this unit's share of the layer's gathered activations: words [w0, w1) of every row in use
  constexpr int NU = P / MOE_COMBINE_COLS, W = F / 2;
  const int w0 = unit * W / NU, w1 = (unit + 1) * W / NU, nw = w1 - w0;
  const int ns = ldg_cgi(p.n_slots);
MK_COLD_LOOP
  for (int s = 0; s < ns; ++s) {
    const int nt = ldg_cgi(p.slot_ntok + s);
    uint32_t* base = reinterpret_cast<uint32_t*>(act_slot(p.recv, cp, s, 0, 0));
    for (int i = tid(); i < nt * nw; i += COMPUTE_THREADS) tp_store(base + (i / nw) * W + w0 + i % nw, BF16X2_EMPTY);
  }
  sync_compute();  // every reset of the unit, then their release (mk/tp.cuh)
  if (tid() == 0) reuse_fence();
}

}  // namespace mk
