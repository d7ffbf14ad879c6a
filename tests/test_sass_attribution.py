"""Code bytes per source (nvdisasm -gi listings): the attribution rule on a fixed listing, and on
the real tiny megakernel when nvdisasm is there."""
import pytest

from megakernel.build import op_of_chain
from microbench.sass import code_bytes_by, find_nvdisasm

LISTING = """\
.text.other:
        /*0000*/                   NOP ;
.text.mk_run:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/r/megakernel/csrc/mk/gemm.cuh", line 77 inlined at "/r/megakernel/csrc/ops/qkv_rope.cuh", line 20
\t//## File "/r/megakernel/csrc/ops/qkv_rope.cuh", line 20 inlined at "/r/megakernel/csrc/mk/program.cuh", line 181
\t//## File "/r/megakernel/csrc/mk/program.cuh", line 181 inlined at "/inline", line 303
\t//## File "/inline", line 303
        /*0010*/                   ISETP.NE.AND P0, PT, R13, R52, PT ;
        /*0020*/              @!P0 BRA `(.L_x_194) ;
\t//## File "/r/megakernel/csrc/mk/program.cuh", line 33 inlined at "/r/megakernel/csrc/mk/program.cuh", line 223
\t//## File "/r/megakernel/csrc/mk/program.cuh", line 223 inlined at "/inline", line 303
\t//## File "/inline", line 303
        /*0030*/                   VIADD R45, R133, 0x8 ;
\t//## File "/r/megakernel/csrc/ops/topk.cuh", line 48 inlined at "/r/megakernel/csrc/mk/program.cuh", line 185
.L_x_194:
        /*0040*/                   FMNMX R3, R3, R4, !PT ;
"""


def test_instructions_take_the_op_on_their_inline_chain():
    got = code_bytes_by(LISTING.splitlines(), op_of_chain, kernel="mk_run")
    # before any annotation: "?"; gemm.cuh inlined into qkv_rope counts as qkv_rope (2 instructions,
    # the second inherits the chain); program.cuh alone is the schedule; a label line does not reset it
    assert got == {"?": 16, "qkv_rope": 32, "schedule": 16, "topk": 16}
    assert sum(code_bytes_by(LISTING.splitlines(), op_of_chain).values()) == 6 * 16  # every function


@pytest.mark.skipif(find_nvdisasm() is None, reason="needs nvdisasm (set MEGABENCH_NVDISASM)")
def test_tiny_megakernel_code_by_op_adds_up():
    from megakernel.build import build_gpu, code_bytes_by_op
    from megakernel.config import preset
    from megakernel.plan import make_plan

    b = build_gpu(make_plan(preset("tiny"), 132))
    by = code_bytes_by_op(b)
    assert sum(by.values()) == b.usage.code_bytes
    assert {"expert_gemm1", "expert_gemm2", "attention", "schedule"} <= set(by)
