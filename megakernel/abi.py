"""The kernel's parameter block and its step block, defined once here: rendered into C++
(`render_structs`) and packed from Python (`pack`, `pack_step`), so the two sides cannot drift apart.

Every Params field is a pointer (8 bytes) or a 32-bit int; C++ sees the typed pointer written
below. The kernel reads the block through a pointer to device memory (the host emulation through a
host pointer), so the layout is the natural C layout of these fields in order.

The step block (`Params.step`, int32 words, STEP_FIELDS) is the shape of one step: its token rows,
its requests, each request's cached positions and first row. It lives in device memory, not in
launch parameters, so a CUDA graph replays any step of the same program and a device loop can
advance it. Per-row arrays (tokens, depth, anc, row_req) stay Params pointers of their own.
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
)

PARAM_FIELDS = (
    ("layers", "const LayerPtrs*"),
    ("embed", "const uint16_t*"),  # [V][D]
    ("final_norm", "const uint16_t*"),
    ("lm_head", "const uint16_t*"),  # [V][D], tiled
    ("rope_cos", "const float*"),  # [MAX_CTX][HD/2]
    ("rope_sin", "const float*"),
    ("program", "const int32_t*"),  # op instances, OPINST_INTS each
    ("step", "const int32_t*"),  # [STEP_INTS] the step's shape (STEP_FIELDS)
    ("kv", "uint16_t* const*"),  # [L][B_MAX][2] request r's K (0) and V (1) cache of a layer, [HKV][slots][HD]
    ("tokens", "const int32_t*"),  # [T_MAX] per row
    ("depth", "const int32_t*"),  # [T_MAX] per row: depth in its request's tree
    ("anc", "const uint32_t*"),  # [T_MAX] per row: bit j: row row0 + j of its request is an ancestor or itself
    ("row_req", "const int32_t*"),  # [T_MAX] per row: its request
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


# Requests of one step: at most one per token row (a request has >= 1 row, rows <= T_MAX <= 16).
B_MAX = 16
# The step block, in order: (name, int32 words). rows: token rows of the step (1..T_MAX), the
# requests' trees concatenated; n_req: requests (1..B_MAX); ctx[r]: request r's cached positions
# before this step; row0[r]: its first row (row0[n_req] = rows). Words past n_req are unused.
STEP_FIELDS = (("rows", 1), ("n_req", 1), ("ctx", B_MAX), ("row0", B_MAX + 1))


def step_offsets() -> dict[str, int]:
    """Word offset of each STEP_FIELDS entry."""
    out, at = {}, 0
    for name, n in STEP_FIELDS:
        out[name] = at
        at += n
    return out


STEP_INTS = sum(n for _, n in STEP_FIELDS)


def pack_step(ctx: list[int], n_rows: list[int]) -> list[int]:
    """The step block of requests with these cached positions and row counts (int32 words)."""
    if not 1 <= len(ctx) == len(n_rows) <= B_MAX:
        raise ValueError(f"{len(ctx)} requests with {len(n_rows)} row counts: want 1..{B_MAX} of each")
    o = step_offsets()
    w = [0] * STEP_INTS
    w[o["rows"]] = sum(n_rows)
    w[o["n_req"]] = len(ctx)
    at = 0
    for r, (c, n) in enumerate(zip(ctx, n_rows)):
        w[o["ctx"] + r] = int(c)
        w[o["row0"] + r] = at
        at += int(n)
    w[o["row0"] + len(ctx)] = at
    return w


def _ctype(c: str):
    return ctypes.c_int32 if c == "int32_t" else ctypes.c_uint64


class LayerPtrs(ctypes.Structure):
    _fields_ = [(n, _ctype(t)) for n, t in LAYER_FIELDS]


class Params(ctypes.Structure):
    _fields_ = [(n, _ctype(t)) for n, t in PARAM_FIELDS]


def render_structs() -> str:
    off = step_offsets()
    out = ["namespace mk {", f"constexpr int B_MAX = {B_MAX};  // requests of one step (abi.py)",
           "// the step block's words (abi.py STEP_FIELDS)"]
    out += [f"constexpr int STEP_{n.upper()} = {off[n]};" for n, _ in STEP_FIELDS]
    out += [f"constexpr int STEP_INTS = {STEP_INTS};", "struct LayerPtrs {"]
    out += [f"  {t} {n};" for n, t in LAYER_FIELDS]
    out += ["};", f"static_assert(sizeof(LayerPtrs) == {ctypes.sizeof(LayerPtrs)}, \"abi.py LayerPtrs\");",
            "struct Params {"]
    out += [f"  {t} {n};" for n, t in PARAM_FIELDS]
    out += ["};", f"static_assert(sizeof(Params) == {ctypes.sizeof(Params)}, \"abi.py Params\");", "}  // namespace mk"]
    return "\n".join(out) + "\n"


def pack(struct: ctypes.Structure) -> bytes:
    return ctypes.string_at(ctypes.addressof(struct), ctypes.sizeof(struct))
