// seed (the drafter's pass, before embed): request r's draft rows hold s_j = succ_d^j(root_r) for
// j = 0 .. its rows - 1 (draft.py DraftModel.seeds: s_0 the root, s_{j+1} = succ_d[s_j]); root_r is
// the speculative state's (the verifier's last `advance`, an earlier launch). succ_d's powers come
// from the host's table (Params.spec_seed, SEED_COLS per token: decode.py seed_table), so a row is
// one load, not the end of a chain of j dependent ones. Writes the rows' tokens; their depths,
// ancestor masks and requests are the pass's fixed chains (written once by the host). Unit = one
// request.
#pragma once
#include "mk/block.cuh"

namespace mk {

MK_DEV void run_seed(Blk& b, int r) {
  const Params& p = *b.p;
  const int j = tid();
  static_assert(T_MAX <= SEED_COLS, "a request's draft rows fit the seed table's columns");
  if (j < req_rows(b, r)) {
    const int root = ldg_cgi(p.spec + r * SPEC_INTS + SPEC_ROOT);
    p.tokens[req_row0(b, r) + j] = ldg_cgi(p.spec_seed + root * SEED_COLS + j);
  }
}

}  // namespace mk
