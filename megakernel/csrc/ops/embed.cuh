// embed: x[t] = embedding row of token t, as fp32 (the residual stream). Unit = one token.
#pragma once
#include "mk/gemm.cuh"

namespace mk {

MK_DEV void run_embed(Blk& b, int unit) {
  const Params& p = *b.p;
  const int tok = p.tokens[unit];
  for (int k = tid(); k < D; k += COMPUTE_THREADS) p.x[unit * D + k] = bf2f(p.embed[static_cast<size_t>(tok) * D + k]);
}

}  // namespace mk
