// qkv projection with RoPE and the KV-cache write. Unit = TILE_QKV_ROWS output rows of wqkv (rows
// are q heads, then k heads, then v heads; the rows divide head_dim, so a unit never straddles heads).
// A = rmsnorm(x, attn_norm) (the norm factor applied to the fp32 result, gemm.cuh stage_normed);
// q, k get interleaved RoPE at position ctx + depth(t) from the shared cos/sin tables; q -> p.q,
// k/v -> the layer's cache at sequence index ctx + t (ring slot in sliding layers). Rounding: fp32
// accumulate, RoPE in fp32, one rounding to bf16.
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
  gemm_stash<R>(b, gemm_bf16<R, TILE_QKV_KC, D, NORM_KP>(b, what, stage));
  const int row0 = unit * R, head = row0 / HD;
MK_COLD_LOOP
  for (int i = tid(); i < 16 * (R / 2); i += COMPUTE_THREADS) {
    const int t = i / (R / 2), n = 2 * (i % (R / 2));
    if (t >= b.T) continue;
    const float r = norm_factor(b, t);
    float a = gemm_sum<R>(b, t, n) * r, c = gemm_sum<R>(b, t, n + 1) * r;
    const int d = row0 % HD + n;  // even: the pair (d, d+1) rotates together
    if (head < HQ + HKV) {
      const int pos = b.ctx + p.depth[t];
      const float cs = p.rope_cos[pos * (HD / 2) + d / 2], sn = p.rope_sin[pos * (HD / 2) + d / 2];
      const float ra = a * cs - c * sn, rc = a * sn + c * cs;
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
