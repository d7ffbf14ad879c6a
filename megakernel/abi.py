"""The kernel's parameter block, defined once here: rendered into C++ (`render_structs`) and
packed from Python (`pack`) with ctypes, so the two sides cannot drift apart.

Every field is a pointer (8 bytes) or a 32-bit int; C++ sees the typed pointer written below.
The kernel reads the block through a pointer to device memory (the host emulation through a
host pointer), so the layout is the natural C layout of these fields in order.
"""
from __future__ import annotations

import ctypes

LAYER_FIELDS = (
    ("attn_norm", "const uint16_t*"),  # [D] bf16
    ("wqkv", "const uint16_t*"),  # [QKV_ROWS][D], tiled (tiling.py) like the dense weights below
    ("wo", "const uint16_t*"),  # [D][ATT_W], tiled
    ("ffn_norm", "const uint16_t*"),  # [D]
    ("router", "const uint16_t*"),  # [E][D], tiled
    ("pool", "const uint16_t*"),  # [P][D], tiled
    ("unpool", "const uint16_t*"),  # [D][P], tiled
    ("w1_codes", "const uint8_t*"),  # [E][2F][P/2]
    ("w1_scales", "const uint8_t*"),  # [E][2F][P/16]
    ("w1_ts", "const float*"),  # [E]
    ("w2_codes", "const uint8_t*"),  # [E][P][F/2]
    ("w2_scales", "const uint8_t*"),  # [E][P][F/16]
    ("w2_ts", "const float*"),  # [E]
    ("k_cache", "uint16_t*"),  # [HKV][slots][HD]
    ("v_cache", "uint16_t*"),
)

PARAM_FIELDS = (
    ("layers", "const LayerPtrs*"),
    ("embed", "const uint16_t*"),  # [V][D]
    ("final_norm", "const uint16_t*"),
    ("lm_head", "const uint16_t*"),  # [V][D], tiled
    ("rope_cos", "const float*"),  # [MAX_CTX][HD/2]
    ("rope_sin", "const float*"),
    ("program", "const int32_t*"),  # op instances, OPINST_INTS each
    ("tokens", "const int32_t*"),  # [T]
    ("depth", "const int32_t*"),  # [T]
    ("anc", "const uint32_t*"),  # [T] ancestor bitmask (bit j: token j is an ancestor or itself)
    ("route_override", "const int32_t*"),  # [L][T_MAX][TOPK] or null
    ("x", "float*"),  # [T_MAX][D] residual stream
    ("ss_part", "float*"),  # [2][T_MAX][D/8] sums of squares of x per 8 features (gemm.cuh ss8)
    ("xg", "uint16_t*"),  # [2][D/NORM_KP][T_MAX][NORM_KP+8] bf16(x * the next norm's gain) (gemm.cuh xg_at)
    ("q", "uint16_t*"),  # [T_MAX][HQ][HD]
    ("att_o", "float*"),  # [HKV][PARTS][G*16][HD]
    ("att_ml", "float*"),  # [HKV][PARTS][G*16][2]
    ("att_out", "uint16_t*"),  # [T_MAX][ATT_W]
    ("router_logits", "float*"),  # [T_MAX][E]
    ("route_sel", "int32_t*"),  # [T_MAX][TOPK]
    ("route_w", "float*"),  # [T_MAX][TOPK]
    ("route_slot", "int32_t*"),  # [T_MAX][TOPK]
    ("route_pos", "int32_t*"),  # [T_MAX][TOPK]
    ("slot_expert", "int32_t*"),  # [MAX_SLOTS]
    ("slot_ntok", "int32_t*"),  # [MAX_SLOTS]
    ("slot_tok", "int32_t*"),  # [MAX_SLOTS][16]
    ("n_slots", "int32_t*"),  # [1]
    ("pooled", "uint16_t*"),  # [T_MAX][P]
    ("act", "uint16_t*"),  # [MAX_SLOTS][16][F]
    ("yexp", "uint16_t*"),  # [MAX_SLOTS][16][P]
    ("ypart", "float*"),  # Plan.fused_experts: [MAX_SLOTS][EXP2_TILES][16][P] down-projection partials
    ("z", "uint16_t*"),  # [T_MAX][P]
    ("logits", "float*"),  # [T_MAX][V]
    ("amax_val", "float*"),  # [V/16][T_MAX]
    ("amax_idx", "int32_t*"),  # [V/16][T_MAX]
    ("out_tokens", "int32_t*"),  # [T_MAX]
    ("counters", "uint32_t*"),  # [2][n_counters]
    ("watchdog", "unsigned long long*"),  # [WD_FIELDS]
    ("n_counters", "int32_t"),
    # ranks (Plan.launch_ranks, tp_ranks): each rank has its own parameter block; a launch of several
    # ranks gets them in rank order and each block picks its rank's (megakernel.cu)
    ("rank", "int32_t"),  # this block's TP rank (0 without TP)
    ("recv", "unsigned char*"),  # TP: this rank's receive slots (Plan.recv_layout), in its own memory
    ("peers", "unsigned char* const*"),  # TP: [tp_ranks] every rank's receive slots as this rank addresses them
    ("rank_slots", "int32_t*"),  # TP expert_parallel: [1 + MAX_SLOTS] this rank's slot count, then its slots
)


def _ctype(c: str):
    return ctypes.c_int32 if c == "int32_t" else ctypes.c_uint64


class LayerPtrs(ctypes.Structure):
    _fields_ = [(n, _ctype(t)) for n, t in LAYER_FIELDS]


class Params(ctypes.Structure):
    _fields_ = [(n, _ctype(t)) for n, t in PARAM_FIELDS]


def render_structs() -> str:
    out = ["namespace mk {", "struct LayerPtrs {"]
    out += [f"  {t} {n};" for n, t in LAYER_FIELDS]
    out += ["};", f"static_assert(sizeof(LayerPtrs) == {ctypes.sizeof(LayerPtrs)}, \"abi.py LayerPtrs\");",
            "struct Params {"]
    out += [f"  {t} {n};" for n, t in PARAM_FIELDS]
    out += ["};", f"static_assert(sizeof(Params) == {ctypes.sizeof(Params)}, \"abi.py Params\");", "}  // namespace mk"]
    return "\n".join(out) + "\n"


def pack(struct: ctypes.Structure) -> bytes:
    return ctypes.string_at(ctypes.addressof(struct), ctypes.sizeof(struct))
