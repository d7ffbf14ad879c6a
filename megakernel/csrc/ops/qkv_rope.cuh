// qkv projection with RoPE and the KV-cache write. Unit = TILE_QKV_ROWS output rows of wqkv (rows
// are q heads, then k heads, then v heads; the rows divide head_dim, so a unit never straddles heads).
// A = rmsnorm(x, attn_norm) (the norm factor applied to the fp32 result, gemm.cuh stage_normed);
// q, k get interleaved RoPE at position ctx + depth(t) from the shared cos/sin tables; q -> p.q,
// k/v -> the layer's cache at sequence index ctx + t (ring slot in sliding layers). Rounding: fp32
// accumulate, RoPE in fp32 (each product and sum rounded), one rounding to bf16.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_qkv(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  constexpr int R = TILE_QKV_ROWS;
  return produce_bf16<R, TILE_QKV_KC, D>(b, b.p->layers[layer].wqkv, unit, c, what);
}

MK_DEV void run_qkv(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  const LayerPtrs& L = p.layers[layer];
  auto stage = [&](int panel) {
    stage_normed(b, 0, ss_part(p, 0), tag_of(TAG_ATTN_NORM, layer, 0), panel, what);
  };  // called by the GEMM before each panel's first chunk
  constexpr int R = TILE_QKV_ROWS;
  static_assert(16 * (R / 2) <= COMPUTE_THREADS, "the epilogue: one output pair per thread");
  const int row0 = unit * R, head = row0 / HD;
  // thread i < 16 * R / 2: token t, output pair (n, n + 1). Its rotation's cos and sin (behind
  // depth[t]: two dependent L2 round trips) are loaded before the GEMM, so that they overlap it
  // instead of ending the layer (the next attention waits for this op). With the rounding pinned
  // below (in-run A/B, H200 2026-11-30 10:35Z): shard8 T=16 -0.23%, T=1 -0.71%, small T=16 -0.67%;
  // the pinned rounding alone -0.13 / +0.06 / -0.18% and error 8.67e-3 -> 8.64e-3 (shard8)
  const int t = tid() / (R / 2), n = 2 * (tid() % (R / 2));
  const int d = row0 % HD + n;  // even: the pair (d, d+1) rotates together
  const bool mine = tid() < 16 * (R / 2) && t < b.T;
  float cs = 1.f, sn = 0.f;
  if (mine && head < HQ + HKV) {
    const int pos = b.ctx + p.depth[t];
    cs = p.rope_cos[pos * (HD / 2) + d / 2];
    sn = p.rope_sin[pos * (HD / 2) + d / 2];
  }
  gemm_stash<R>(b, gemm_bf16<R, TILE_QKV_KC, D, NORM_KP>(b, what, stage));
  if (mine) {
    const float r = norm_factor(b, t);
    float a = gemm_sum<R>(b, t, n) * r, c = gemm_sum<R>(b, t, n + 1) * r;
    if (head < HQ + HKV) {
      // each product and the sum rounded on its own (as the fp32 reference does): with the
      // compiler free to fuse a multiply into the add, moving this code changed the bits
      const float ra = fadd_rn(fmul_rn(a, cs), -fmul_rn(c, sn));
      const float rc = fadd_rn(fmul_rn(a, sn), fmul_rn(c, cs));
      a = ra;
      c = rc;
    }
    const uint32_t packed = pack_bf2(a, c);
    if (head < HQ) {
      *reinterpret_cast<uint32_t*>(p.q + (t * HQ + head) * HD + d) = packed;
    } else {
      const bool is_k = head < HQ + HKV;
      const int kvh = is_k ? head - HQ : head - HQ - HKV;
      uint16_t* cache = is_k ? L.k_cache : L.v_cache;
      const size_t off = (static_cast<size_t>(kvh) * cache_slots(layer) + cache_slot(layer, b.ctx + t)) * HD + d;
      *reinterpret_cast<uint32_t*>(cache + off) = packed;
    }
  }
}

}  // namespace mk
