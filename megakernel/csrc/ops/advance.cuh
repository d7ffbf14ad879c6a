// advance (the verifier's step, its last op): the only writer of the state the next step reads.
// For each request with a path this step (len > 0): ctx_r += len in the step block (the accepted
// tokens' K/V now sit at the old ctx_r .. ctx_r + len - 1), root_r = the bonus, n_out += len (accept
// wrote the tokens) and hist[len] += 1. Every op that reads that state (tree, accept, compact) runs
// before it (program.check: its launch's dependencies order it after every compact unit, and so
// after every accept unit), and the next launch reads it only once this one has ended. Danger: a
// block of this launch that loads the step block late (load_step) may see the new ctx; it then
// has no unit left that reads ctx (every compact unit is done), and rows and requests do not
// change. Unit: one, a thread per request.
#pragma once
#include "mk/block.cuh"

namespace mk {

MK_DEV void run_advance(Blk& b) {
  const Params& p = *b.p;
  const int r = tid();
  if (r < step_nreq(b)) {
    int32_t* st = p.spec + r * SPEC_INTS;
    const int len = ldg_cgi(st + SPEC_LEN);
    if (len > 0) {
      p.step[STEP_CTX + r] = req_ctx(b, r) + len;
      st[SPEC_ROOT] = ldg_cgi(st + SPEC_BONUS);
      st[SPEC_N_OUT] = ldg_cgi(st + SPEC_N_OUT) + len;
      st[SPEC_HIST + len] = ldg_cgi(st + SPEC_HIST + len) + 1;
    }
  }
}

}  // namespace mk
