// tree (the verifier's step, before embed): request r's verify tree from its root and the drafter's
// top-2 (speculative.build_tree's rule). Row row0_r + i holds node i of the fixed shape, whose
// parent, depth, rank and ancestor mask are the host's table (Params.spec_tree, from
// speculative.tree_ranks: decode.py tree_table): node 0 is the root (the speculative state's,
// written by the last step's `advance`), node i at depth d >= 1 the drafter's guess of its rank for
// depth d, i.e. entry `rank` of the top-2 of the request's draft row d - 1. Request r's draft rows
// are its verify rows less one (decode.py lays them out so), so they start at row0_r - r. Writes
// the rows' tokens, depths and ancestor masks. Unit = one request.
#pragma once
#include "mk/block.cuh"

namespace mk {

MK_DEV void run_tree(Blk& b, int r) {
  const Params& p = *b.p;
  const int i = tid(), row0 = req_row0(b, r);
  if (i < req_rows(b, r)) {
    const int32_t* node = p.spec_tree + (row0 + i) * TREE_INTS;
    const int depth = ldg_cgi(node + TREE_DEPTH);
    const int tok = i == 0 ? ldg_cgi(p.spec + r * SPEC_INTS + SPEC_ROOT)
                           : ldg_cgi(p.spec_top2 + (row0 - r + depth - 1) * 2 + ldg_cgi(node + TREE_RANK));
    p.tokens[row0 + i] = tok;
    p.depth[row0 + i] = depth;
    p.anc[row0 + i] = static_cast<uint32_t>(ldg_cgi(node + TREE_ANC));
  }
}

}  // namespace mk
