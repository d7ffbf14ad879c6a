// embed: x[t] = embedding row of token t, as fp32 (the residual stream), and for the first
// attention norm the row's sums of squares per 8 features (gemm.cuh ss8) and bf16(x * attn_norm)
// (xg_at). Unit = one token.
#pragma once
#include "mk/gemm.cuh"

namespace mk {

MK_DEV void run_embed(Blk& b, int unit) {
  const Params& p = *b.p;
  const int tok = ldg_cgi(p.tokens + unit);  // L2: a spec program's seed / tree op wrote it in this launch
  for (int g = tid(); g < D / 8; g += COMPUTE_THREADS) {
    const uint4 e = ldg_nc4(p.embed + static_cast<size_t>(tok) * D + 8 * g);
    const uint32_t w[4] = {e.x, e.y, e.z, e.w};
    float v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = bf2f(static_cast<uint16_t>(w[i] & 0xffffu));
      v[2 * i + 1] = bf2f(static_cast<uint16_t>(w[i] >> 16));
    }
    float* xr = p.x + unit * D + 8 * g;
#pragma unroll
    for (int i = 0; i < 8; ++i) xr[i] = v[i];
    ss_part(p, 0)[unit * (D / 8) + g] = ss8(v);
    const uint4 gg = ldg_nc4(p.layers[0].attn_norm + 8 * g);  // the first attention norm's gain
    const uint32_t gw[4] = {gg.x, gg.y, gg.z, gg.w};
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      o[i] = pack_bf2(v[2 * i] * bf2f(static_cast<uint16_t>(gw[i] & 0xffffu)),
                      v[2 * i + 1] * bf2f(static_cast<uint16_t>(gw[i] >> 16)));
    *reinterpret_cast<uint4*>(xg_at(p, 0, unit, 8 * g)) = uint4{o[0], o[1], o[2], o[3]};
  }
}

}  // namespace mk
