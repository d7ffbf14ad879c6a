"""Build constants: the model config and the tuned constants turned into one frozen Plan, and
the Plan rendered into the kernel source as `constexpr` with `static_assert`s.

Everything the CUDA side knows about shapes, tiles, the ring and the op table comes from here
(`render()`); nothing is typed twice. The cache key of the compiled kernel covers the rendered
text, so a changed constant recompiles.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from microbench.errors import KernelDoesNotFitError

from . import fp4_layout
from .abi import B_MAX, STEP_INTS
from .config import ModelConfig

# op kinds, in the order they run inside a layer (the C++ enum is rendered from this tuple), then the
# speculative step's, which only spec programs hold (program.build): the drafter's `seed` (its rows'
# tokens from the roots) and the verifier's `tree` (the verify tree from the draft's top-2), `accept`
# (greedy walk, emitted tokens), `compact` (the accepted rows' K/V to consecutive positions) and
# `advance` (the step state the next step reads). Appended: the other kinds keep their numbers
OP_KINDS = ("embed", "qkv", "attn", "attn_combine", "oproj", "router", "pool", "topk", "expert1", "expert2",
            "moe_combine", "unpool", "lm_head", "argmax",
            "attn_reduce",  # TP: the attention all-reduce, after oproj
            "seed", "tree", "accept", "compact", "advance")
SPEC_KINDS = ("seed", "tree", "accept", "compact", "advance")
OP = {k: i for i, k in enumerate(OP_KINDS)}
# Plan.union_experts (program.grouped): the ops that run once over every row group's routing, and
# the ops whose every group's instance bumps group 0's counters (rendered: UNION_SHARED_MASK, whose
# consumers wait for every active group's units, program.cuh all_target)
UNION_OPS = ("expert1", "expert2")
UNION_SHARED = ("topk", "pool")
WARPS = 8  # compute warps per block (one mma m16 row tile of tokens each)
LOADER_WARPS = 1  # the weight-streaming warp (ring producer)
THREADS = 32 * (WARPS + LOADER_WARPS)  # the default block; Plan.threads is the plan's
# Plan.compute_registers: setmaxnreg moves registers between whole warpgroups (4 warps), so a
# split block is three: the compute warps' two and the loader's (the loader and 3 warps that only
# give their registers back). 12 warps get the same 168 registers each as 9 at one block per SM
# (65,536 / 384, down to a multiple of 8).
BASE_REGISTERS = 168
SPLIT_THREADS = 32 * (WARPS + 4)
ROW_PAD = 16  # bytes of padding per staged row: spreads rows over banks for the fragment loads
PROF_OPS = 16  # block.cuh: the profiler's deferred op-stamp slots (in MISC; rendered)
MISC_SCRATCH = 58  # block.cuh: the first MISC int of top-k's scratch, past the fixed slots (rendered)
# Expert units: every unit pays a fixed overhead (barriers, epilogue, signal), so fewer, larger
# units pay it less often; the cost is a longer tail (a block's last unit). The bound on the other
# side: a unit of at most EXPERT_MAX_ROWS rows (two 16-row tiles per compute warp).
EXPERT1_ROWS = 128  # gate/up unit: 64 gate + the 64 matching up rows
EXPERT2_ROWS = 256  # down-projection unit
# moe_combine unit: one output per thread, so a unit's loads are one L2 round trip, not several
MOE_COMBINE_COLS = 16
DENSE_ROWS = 16  # qkv / oproj / pool / unpool unit rows: at 8 the per-unit overhead is paid twice per 16 KB
ROUTER_ROWS = 8  # the router stays at 8: top-k waits for it, and 32 units spread it over 32 blocks
MIN_CHUNK_COLS = 64  # the narrowest bf16 weight chunk _tile accepts


def pool_rows(cfg: ModelConfig, n_sm: int, stage_budget: int) -> int:
    """Pooler unit rows: DENSE_ROWS, or twice that where only then the router's and the pooler's
    units fit the grid side by side (program.pool_rotation puts them on different blocks). Top-k
    waits for the router, expert GEMM 1 for top-k and the pooler: a block that runs a pool unit
    after its router unit delays every expert (shard8 on 132 SMs: 32 router + 128 pool units of 16
    rows do not fit side by side, 64 of 32 do). The larger unit needs a stage of at least
    MIN_CHUNK_COLS of its columns."""
    r, big = cfg.n_experts // ROUTER_ROWS, 2 * DENSE_ROWS
    if r + cfg.d_pool // DENSE_ROWS > n_sm and r + cfg.d_pool // big <= n_sm and cfg.d_pool % big == 0 \
            and big * MIN_CHUNK_COLS * 2 <= stage_budget:
        return big
    return DENSE_ROWS


def residual_rows(cfg: ModelConfig, n_sm: int, stage_budget: int) -> int:
    """oproj / unpool unit rows (d_model outputs each): DENSE_ROWS, or twice that where the grid
    does not hold every DENSE_ROWS unit at once. A block's second unit costs a whole epilogue and
    unit boundary, several times the gap between two chunks of one unit (shard8 on 132 SMs: 256
    units of 16 rows, so 124 blocks would run two). The larger unit needs a stage of at least
    MIN_CHUNK_COLS of its columns."""
    big = 2 * DENSE_ROWS
    if cfg.d_model // DENSE_ROWS > n_sm and cfg.d_model % big == 0 and big * MIN_CHUNK_COLS * 2 <= stage_budget:
        return big
    return DENSE_ROWS


def expert1_unit_rows(cfg: ModelConfig, n_sm: int, tokens: int) -> int:
    """Gate/up unit rows to try first (_expert_tile halves them while a chunk does not fit the stage):
    twice EXPERT1_ROWS where even then a step of `tokens` tree tokens, at most tokens x top_k distinct
    experts, has units for two rounds of the grid, else EXPERT1_ROWS. Half the units pay half the
    per-unit barriers, epilogues and signals; where the larger units would leave blocks without one
    (shard8 T=1: 64 units on 132 SMs, where 128 rows give 128) the idle blocks cost more than that."""
    big = 2 * EXPERT1_ROWS
    return big if cfg.max_distinct_experts(tokens) * (2 * cfg.d_expert // big) >= 2 * n_sm else EXPERT1_ROWS


def expert2_unit_rows(cfg: ModelConfig, n_sm: int, tokens: int) -> int:
    """Down-projection unit rows to try first: EXPERT2_ROWS, or half where a step of `tokens` tree
    tokens (at most tokens x top_k distinct experts) would not have a unit for every block at
    EXPERT2_ROWS (shard8 T=1: 64 units on 132 SMs)."""
    fills = cfg.max_distinct_experts(tokens) * (cfg.d_pool // EXPERT2_ROWS) >= n_sm
    return EXPERT2_ROWS if fills else EXPERT2_ROWS // 2


EXPERT_MIN_ROWS = 32  # the smallest expert unit: 16 gate + 16 up rows (a row tile never mixes them)
EXPERT_MAX_ROWS = 2 * 16 * WARPS  # gemm_fp4: at most two 16-row tiles per compute warp
# An fp4 chunk's columns: the kernel's copy of the expert banks is stored in blocks of this many
# columns of all rows (tiling.tile_fp4_*), one copy per model that every build reads (T=1 and T=16
# builds alike: a second copy of shard8's ~54 GB of banks does not fit beside the first), so the
# chunk width is the model's, not the unit's: 256 columns (128-byte code rows, which the 8-row
# swizzle spreads over all banks) or the largest power of two dividing K below that.
FP4_KC = 256
FP4_MIN_KC = 64  # whole pairs of k32 steps (one code ldmatrix.x4 brings two)


def fp4_kc(k: int) -> int:
    """The chunk (and storage block) columns of an fp4 matrix of K columns."""
    kc = FP4_KC
    while k % kc:
        kc //= 2
    if kc < FP4_MIN_KC:
        raise ValueError(f"fp4 K={k}: no chunk of >= {FP4_MIN_KC} columns divides it")
    return kc


def _expert_tile(cap: int, k: int, budget: int, paired: bool) -> GemmTile:
    """The largest expert unit, from `cap` rows halving down to EXPERT_MIN_ROWS, whose chunk
    (fp4_kc(k) columns of all its rows) fits the stage budget; refused when even the smallest does
    not. paired: gate/up, half the rows gate rows (a 16-row tile is all gate or all up rows)."""
    kc = fp4_kc(k)

    def need(r: int) -> int:  # a chunk's bytes: codes and scales of r rows
        return GemmTile(r, kc, k, True).stage_bytes

    rows = min(cap, EXPERT_MAX_ROWS)
    while need(rows) > budget and rows // 2 >= EXPERT_MIN_ROWS:
        rows //= 2
    if need(rows) > budget:
        raise KernelDoesNotFitError(
            f"expert unit of {rows} rows x {kc} columns of K={k}: a chunk needs {need(rows)} B, the ring "
            f"stage holds {budget} B of fp4 weights")
    if paired and (rows // 2) % 16:
        raise ValueError(f"gate/up unit of {rows} rows: {rows // 2} gate rows are not whole 16-row tiles")
    return GemmTile(rows, kc, k, True, min(fp4_layout.SWIZZLE_MAX, kc // 32))


FUSED_PASS_ROWS = 2 * 16 * WARPS  # gemm.cuh gemm_fp4_down: two 16-row tiles per compute warp per pass


TP_RANKS = (1, 2, 4, 8)  # the tensor-parallel degrees a build takes (the study runs 8)


def tp_problem(cfg: ModelConfig, ranks: int) -> str | None:
    """Why `cfg` cannot be sharded over `ranks` tensor-parallel ranks (None: it can): every rank
    needs whole kv heads, and whole 16-row tiles of its gate/up rows (d_expert / R) and of its
    down-projection rows (d_pool / R); oproj's K groups (attn_width / R at the most) need whole
    64-column chunks."""
    if ranks not in TP_RANKS:
        return f"{ranks} ranks: a build takes {', '.join(map(str, TP_RANKS))}"
    if cfg.n_kv_heads % ranks:
        return f"{cfg.n_kv_heads} kv heads do not divide over {ranks} ranks"
    for name, n in (("d_expert", cfg.d_expert), ("d_pool", cfg.d_pool)):
        if n % (16 * ranks):
            return f"{name}={n}: {ranks} ranks get no whole 16-row tiles of it"
    if cfg.attn_width % (MIN_CHUNK_COLS * ranks):
        return f"attn_width={cfg.attn_width}: {ranks} K groups of oproj are not whole {MIN_CHUNK_COLS}-column chunks"
    return None


def max_tp_ranks(cfg: ModelConfig) -> int:
    """The most tensor-parallel ranks the model allows (TP_RANKS): oproj's fixed K groups
    (Plan.tp_groups), so that its all-reduce sums the same partials in the same order at every R."""
    return max(r for r in TP_RANKS if tp_problem(cfg, r) is None)


def fuses_experts(cfg: ModelConfig) -> bool:
    """Whether the model's shapes allow the fused expert unit (Plan.fused_experts): d_pool in whole
    passes of gemm_fp4_down (make_plan also needs a gate/up unit's gate rows in whole k32 steps)."""
    return cfg.d_pool % FUSED_PASS_ROWS == 0 and cfg.d_expert % 32 == 0


def _fused_down_tile(c: ModelConfig, h1: int, budget: int) -> GemmTile:
    """Plan.fused_experts: the down projection's chunk, `rows` rows of d_pool over one gate/up
    unit's h1 columns of K = d_expert (the kernel's copy of W2 in blocks of h1 columns); the rows
    are the most, a multiple of 256 (two 16-row tiles per warp per pass, gemm_fp4_down) dividing
    d_pool, whose chunk fits `budget` (the largest of the other ops' chunks)."""
    if h1 % 32 or c.d_pool % FUSED_PASS_ROWS:
        raise ValueError(f"fused_experts: needs gate rows per unit ({h1}) a multiple of 32 and d_pool "
                         f"({c.d_pool}) a multiple of {FUSED_PASS_ROWS}")
    rows = FUSED_PASS_ROWS
    while c.d_pool % (2 * rows) == 0 and GemmTile(2 * rows, h1, c.d_expert, True).stage_bytes <= budget:
        rows *= 2
    t = GemmTile(rows, h1, c.d_expert, True, min(fp4_layout.SWIZZLE_MAX, h1 // 32))
    if t.stage_bytes > budget:
        raise KernelDoesNotFitError(f"fused_experts: a down-projection chunk of {rows} rows x {h1} columns needs "
                                    f"{t.stage_bytes} B, the ring stage holds {budget} B of fp4 weights")
    return t


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


@dataclass(frozen=True)
class GemmTile:
    """One unit = `rows` output features over all of K, streamed in chunks of `kc` columns of all
    `rows` rows (one ring stage each).

    bf16 (dense): a chunk is rows of kc bf16, padded in smem against bank conflicts; the weights are
    stored tiled (tiling.tile_dense), so a chunk is one bulk copy.
    fp4 (expert): a chunk is the rows' kc/2 code bytes, then their kc/16 E4M3 scale bytes; the
    kernel's copy of the codes and scales is stored in blocks of kc columns of all rows
    (tiling.tile_fp4_*), so a run of consecutive rows is one bulk copy (a gate/up unit's chunk is
    two runs). kc is the model's (fp4_kc), the rows the build's. Each compute warp owns whole
    16-row tiles over all of K (gemm.cuh gemm_fp4), so no warp's partial sum meets another's.
    Code rows kc/2 bytes apart would put the 8 rows of a code ldmatrix on the same banks: they are
    stored swizzled, 16-byte unit u of row r at u ^ (r % swizzle) (fp4_layout.swizzle_units), and
    each row's scales in two planes, one per k16 half (fp4_layout.scale_planes), so a thread loads
    only the bytes of its half.
    """

    rows: int
    kc: int
    k: int
    fp4: bool
    swizzle: int = 0  # fp4: the code rows' 16-byte unit swizzle period (min(8, kc / 32))
    rotated: bool = False  # fp4: the kernel's codes are device words (fp4_layout.ROT_PAIRS; Plan.fp4_rotated)

    @property
    def chunks(self) -> int:
        return self.k // self.kc

    @property
    def row_stride(self) -> int:
        """smem bytes per staged row: kc bf16 and the pad (bf16), kc/2 code bytes (fp4)."""
        return self.kc // 2 if self.fp4 else self.kc * 2 + ROW_PAD

    @property
    def stage_bytes(self) -> int:
        return self.rows * (self.row_stride + (self.kc // 16 if self.fp4 else 0))


def _tile(rows: int, k: int, stage_budget: int) -> GemmTile:
    """bf16: the widest power-of-two chunk whose bytes fit the stage budget and divides K."""
    kc = min(_pow2_floor(int(stage_budget / (rows * 2.0))), k)
    while k % kc:
        kc //= 2
    if kc < MIN_CHUNK_COLS:
        raise ValueError(f"chunk of {kc} columns for K={k}: too narrow")
    return GemmTile(rows, kc, k, False)


@dataclass(frozen=True)
class Plan:
    cfg: ModelConfig
    n_sm: int
    ring_stages: int
    ring_stage_bytes: int  # budget per stage (tuned); actual stage size = max over tiles
    spin_bound_ns: int
    poll_backoff_ns: int
    # keys per attention split: the runs of a kv head's keys are this long, at most MAX_SPLITS of
    # them. Shorter runs spread attention over more blocks; a run shorter than a staging round
    # (attn_round_keys) still stages and scores a whole round, except the sub-blocks past its end,
    # which attention.cuh skips (that skip is what makes 32 pay)
    keys_per_split: int = 32
    profile: bool = False
    # performance techniques, each a build constant so that its contribution can be measured; every
    # combination computes the same bits
    loader_ahead: bool = True  # the loader streams the next op's weights before this op ends
    pdl: bool = False  # programmatic dependent launch between the step's launches
    # the ring's weight copies carry an L2 evict-first hint (arch.cuh bulk_copy); plan_for takes it
    # from the tuned constant evict_first_pays (weights.l2)
    stream_evict_first: bool = False
    # top-k reads the router logits as sentinel slots (empty = -0.0, mb/sentinel.cuh): no counter,
    # no release fence on the router blocks, no acquire on top-k's block; top-k resets them.
    # plan_for takes it from the tuned constant sentinel_pays (sync.publish)
    sentinel_route: bool = False
    # bytes of never-run code placed ahead of the kernel's body (megakernel.cu): a code-layout
    # placebo for A/Bs, the same work with every later instruction at another address
    layout_pad: int = 0
    # bytes of never-run code in the middle of the ops' code (program.cuh run_unit, expert GEMM
    # 1's case): a placebo that moves the code after it against the code before it, as an edit in
    # the middle of the kernel does (layout_pad moves all of it together)
    layout_gap: int = 0
    # a fused expert unit: the down projection's unit j of a slot is the K-part of gate/up unit j
    # (its H1 columns of W2, all d_pool rows, in chunks of tiles["expert2"].rows rows), run by the
    # block that ran gate/up unit j (program.DEP_LOCAL), writing fp32 partials the MoE combine
    # sums in a fixed order: no gate/up groups, no waits between the two GEMMs
    fused_experts: bool = False
    # fused: gate/up units whose activations a block keeps in shared memory, in the down
    # projection's staged layout, so that its unit of the same index stages nothing (make_plan:
    # as many as the spare shared memory holds, up to KEEP_MAX)
    keep_units: int = 0
    # attention: the key groups of a block (attn_key_groups warps per q head, each scoring its
    # share of every staged round) merge their (O, m, l) in shared memory, in key-group order,
    # before the block writes, so a split writes one partial instead of attn_key_groups and the
    # combine loads that many fewer. The merge is inside the unit: a request's bits still depend
    # on its own context alone, at every B and in both modes. Off: one partial per key group
    merge_key_groups: bool = False
    profile_cap: int = 64  # profiler records per block per launch
    # the profiler also stamps inside units (staging, ring waits: profile_events.DETAIL_PHASES);
    # several stamps per weight chunk, so more overhead than the op phases alone
    profile_detail: bool = False
    # the kernel's copy of the expert codes is in device words (fp4_layout.ROT_PAIRS: 9 SASS per
    # code word to decode instead of 10, fewer of them on the ALU pipe; GemmTile.rotated, the
    # engine keeps the copy: tiling.tile_fp4). Same values, same bits
    fp4_rotated: bool = True
    # The normed operand of the d_model-K projections (qkv, router, pool, lm_head) is staged in
    # panels of this many columns (0 = all of d_model at once), so that abuf need not hold 16 rows
    # of d_model and its bytes can go to the ring (make_plan fill_ring)
    norm_panel: int = 0
    # per-role register budgets (0 = off: 9 warps of 168). N: a 12-warp block whose compute warps
    # raise their budget to N registers (setmaxnreg.inc) with what the loader's warpgroup gives
    # back (setmaxnreg.dec to loader_registers); ptxas allocates each role's code to its budget
    compute_registers: int = 0
    ring_fill: int = 0  # of ring_stages, those added from spare shared memory (make_plan fill_ring)
    # ranks that share one launch (runtime.RankEngine): block b of a launch of `grid` blocks is rank
    # b * launch_ranks / grid, and every block index and count the kernel uses is its rank's (arch.cuh
    # bid, nblocks). 1: a launch is one rank's (every build without ranks, and one process per GPU),
    # which compiles to the code of a build that knows nothing of ranks
    launch_ranks: int = 1
    # row groups (groups.GroupEngine): a step of more rows than one m16 token tile is whole requests
    # packed into up to this many groups of at most max_tree rows, each with its own parameter
    # block (buffers, step block, routing), their op instances interleaved in one launch
    # (program.grouped): every op sees one group's rows, so each group's bits are those of its own
    # step. 1: no groups, which compiles to the code of a build that knows nothing of them
    row_groups: int = 1
    # row groups: the routed experts of every group run as one set of units over the union of the
    # groups' routing (union slots: an expert's tokens of every group, at most 16 a slot, in group
    # then row order), so an expert's weights are streamed once per 16 of its tokens in the step,
    # not once per group that routes to it. Each token's expert output is the same dot products
    # as in its group's own slot, so the bits are too. make_plan turns it on with row groups; off
    # there (each group streaming its own experts) is an ablation, slower wherever groups share
    # experts (reports/LEVERS.md)
    union_experts: bool = False
    # tensor parallelism (0: none). R >= 1: the model sharded over R ranks as the study shards it:
    # attention by heads (a rank's q and kv heads, its KV cache), oproj K-sharded into tp_groups
    # fixed groups whose fp32 partials every rank sums in group order (the attention all-reduce),
    # gate/up and the down projection N-sharded, each followed by a bf16 all-gather; the rest
    # replicated. R = 1 is the unsharded result of the same build (it computes every group itself)
    tp_ranks: int = 0
    tp_groups: int = 0  # oproj's K groups (the most ranks the model allows: max_tp_ranks)
    # TP: a slot's expert GEMM units on the rank that owns its expert (expert e on rank e % R, whole
    # rows) instead of N-sharded over every rank: the expert-parallel arrangement, with the same
    # units and so the same bits
    expert_parallel: bool = False
    tiles: dict = field(default_factory=dict, compare=False)

    @property
    def threads(self) -> int:
        """Threads per block: 9 warps, or 12 with per-role register budgets (compute_registers)."""
        return SPLIT_THREADS if self.compute_registers else THREADS

    @property
    def loader_registers(self) -> int:
        """The loader warpgroup's budget under compute_registers (0 when off): the 4 warps of the
        loader's group give back what the 8 compute warps take above 168 (the CTA's register pool
        must balance, or setmaxnreg.inc waits forever)."""
        n = self.compute_registers
        return BASE_REGISTERS - 2 * (n - BASE_REGISTERS) if n else 0

    @property
    def fused_parts(self) -> int:
        """fused_experts: the K-parts of a slot's down projection, one per gate/up unit."""
        return self.cfg.d_expert // (self.tiles["expert1"].rows // 2)

    @property
    def max_slots(self) -> int:
        return self.cfg.max_distinct_experts(self.cfg.max_tree)

    @property
    def max_uslots(self) -> int:
        """union_experts: the most union slots a step makes (0 without). An expert with n tokens
        takes ceil(n / 16) <= n / 16 + 1 slots; the tokens number at most groups x max_tree x top_k,
        the experts at most the distinct ones of that many tokens."""
        if not self.union_experts:
            return 0
        g, c = self.row_groups, self.cfg
        return g * c.top_k * c.max_tree // 16 + c.max_distinct_experts(g * c.max_tree)

    @property
    def rcfg(self) -> ModelConfig:
        """The shapes one rank holds: its q and kv heads (tp_ranks); the model itself otherwise."""
        if not self.tp_ranks:
            return self.cfg
        c = self.cfg
        return replace(c, n_heads=c.n_heads // self.tp_ranks, n_kv_heads=c.n_kv_heads // self.tp_ranks)

    @property
    def expert_rows(self) -> tuple[int, int]:
        """Rows per expert of a rank's share of the expert banks: (gate rows, down-projection rows).
        N-sharded TP: d_expert / R and d_pool / R; whole experts otherwise (expert_parallel, no TP)."""
        c = self.cfg
        if self.tp_ranks and not self.expert_parallel:
            return c.d_expert // self.tp_ranks, c.d_pool // self.tp_ranks
        return c.d_expert, c.d_pool

    @property
    def recv_layout(self) -> dict[str, tuple[int, int]]:
        """TP: a rank's receive slots, {name: (byte offset, bytes)} in one block every rank can
        address, each double-buffered by layer parity (csrc/mk/tp.cuh): "ar" the attention
        all-reduce's fp32 partials [2][tp_groups][T_MAX][D], "act" the gate/up activations' bf16
        gather [2][MAX_SLOTS][16][F], "y" the expert outputs' bf16 gather [2][MAX_SLOTS][16][P].
        Each region starts 256-byte aligned."""
        if not self.tp_ranks:
            return {}
        c = self.cfg
        out, off = {}, 0
        for name, n in (("ar", 2 * self.tp_groups * c.max_tree * c.d_model * 4),
                        ("act", 2 * self.max_slots * 16 * c.d_expert * 2), ("y", 2 * self.max_slots * 16 * c.d_pool * 2)):
            out[name] = (off, n)
            off += -(-n // 256) * 256
        return out

    @property
    def recv_bytes(self) -> int:
        return sum(-(-n // 256) * 256 for _, n in self.recv_layout.values())

    @property
    def max_splits(self) -> int:
        # the whole model's kv heads, also in a TP build: a rank's attention splits (and so its
        # bits) are those of the unsharded model
        c = self.cfg
        most_keys = max(c.max_context, c.window) + c.max_tree  # cached keys seen + the new tree keys
        return max(1, min(self.n_sm // c.n_kv_heads if self.n_sm >= c.n_kv_heads else 1,
                          math.ceil(most_keys / self.keys_per_split)))

    @property
    def attn_key_groups(self) -> int:
        """Warps of an attention block per q head (attention.cuh ATT_KG); each holds a partial of
        its split (written, or merged in the block: attn_partials_per_split)."""
        return WARPS // self.cfg.group

    @property
    def attn_partials_per_split(self) -> int:
        """Partials a split writes (attention.cuh ATT_PPS): one where the key groups merge in the
        block (merge_key_groups), else one per key group."""
        return 1 if self.merge_key_groups else self.attn_key_groups

    @property
    def attn_parts(self) -> int:
        """Attention partials per kv head (PARTS): splits x partials per split."""
        return self.max_splits * self.attn_partials_per_split

    @property
    def stage_bytes(self) -> int:
        return max(t.stage_bytes for t in self.tiles.values())

    @property
    def norm_k(self) -> int:
        """Columns of the normed operand staged at a time (a panel; d_model when unpaneled)."""
        return self.norm_panel or self.cfg.d_model

    @property
    def xg_row(self) -> int:
        """bf16 per row of xg, the producers' bf16(x * g) in the consumers' staged layout: a panel
        of norm_k columns and abuf's pad (gemm.cuh XG_ROW, xg_at; runtime's xg buffer)."""
        return self.norm_k + ROW_PAD // 2

    @property
    def abuf_bytes(self) -> int:
        """Activation operand: 16 token rows x the widest K staged at once, padded (attention
        reuses it)."""
        c = self.cfg
        kmax = max(self.norm_k, self.rcfg.attn_width, c.d_pool, c.d_expert)
        return max(16 * (kmax * 2 + ROW_PAD), self.attn_smem_bytes)

    @property
    def attn_round_keys(self) -> int:
        """Keys attention stages per round (attention.cuh ATT_KB): 32, the default split's run, or 16
        per key group where a block has more than two. A round longer than a split's run stages and
        zero-fills keys nobody scores."""
        return max(32, 16 * self.attn_key_groups)

    @property
    def attn_smem_bytes(self) -> int:
        c = self.cfg
        q = c.group * 16 * (c.head_dim * 2 + ROW_PAD)
        kv = 2 * self.attn_round_keys * (c.head_dim * 2 + ROW_PAD)  # K rows + V rows
        return q + kv + WARPS * 16 * 4 * 2  # + per-warp row stats for the intra-block merge

    @property
    def red_bytes(self) -> int:
        """Per-warp partial tiles of the bf16 GEMMs, [WARPS][16][rows] fp32, and the fp4 GEMMs'
        results, [16][rows] fp32 (gemm.cuh gemm_stash, gemm_fp4)."""
        dense = WARPS * 16 * max(t.rows for t in self.tiles.values() if not t.fp4) * 4
        # fused_experts: the down projection stores from registers (gemm.cuh gemm_fp4_down)
        fp4 = [n for n, t in self.tiles.items() if t.fp4 and not (n == "expert2" and self.fused_experts)]
        return max([dense] + [16 * self.tiles[n].rows * 4 for n in fp4])

    @property
    def keep_unit_bytes(self) -> int:
        """fused: one kept gate/up unit's activations, 16 token rows of its gate rows, padded."""
        return 16 * (self.tiles["expert1"].rows + ROW_PAD)

    @property
    def keep_bytes(self) -> int:
        return self.keep_units * self.keep_unit_bytes

    @property
    def misc_bytes(self) -> int:
        """The ring's mbarriers and block.cuh's MISC ints (top-k scratch, profiler slots, kept-unit
        tags, the step block's copy), as block.cuh lays them out, in 16-byte units. Sized exactly, not rounded up to a
        fixed size: every byte left over can decide whether another ring stage fits. block.cuh's
        static_assert fails the build if this differs from its layout."""
        c = self.cfg
        rtag = MISC_SCRATCH + c.max_tree * c.top_k + 2 * ((c.n_experts + 31) // 32) + c.n_experts  # MISC_RTAG
        pslot = (rtag + 1 + 16 + 1) & ~1  # MISC_PSLOT: past RTAG and RNORM[16], 8-byte aligned
        # PSLOT, PWIN, PWAIT, KEEP, then the step's shape: STEP, ROW_REQ, SPLITS, SPAN
        # (row groups: a copy of the step's shape per group, then two routed-count copies per group)
        area = STEP_INTS + (c.max_tree + 3) // 4 + B_MAX + 2
        g = self.row_groups
        ints = pslot + 8 * PROF_OPS + 2 + 2 + KEEP_MAX + g * area + (2 * g if g > 1 else 0)
        bars = 2 * self.ring_stages + 1  # full and empty per stage, xbar
        return -(-(bars * 8 + 4 * ints) // 16) * 16

    @property
    def smem_bytes(self) -> int:
        return self.abuf_bytes + self.ring_stages * self.stage_bytes + self.red_bytes + self.keep_bytes + self.misc_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cfg"] = self.cfg.name
        d["tiles"] = {k: asdict(v) for k, v in self.tiles.items()}
        return d


NORM_OPS = ("qkv", "router", "pool", "lm_head")  # the projections of a normed d_model operand
RING_FILL_MAX = 8  # fill_ring stops at this many stages
# ... or at this many bytes of ring. The expert phase's consumers, not the ring, set its pace: a
# deeper ring in place of kept gate/up units (shard8 T=16's 4th 36 KB stage, 147,456 B) was slower
# where the units it displaced were kept (reports/LEVERS.md, ring depth).
RING_FILL_BYTES = 136 * 1024
# row groups (Plan.row_groups): each adds a copy of the step's shape to misc (misc_bytes); 8 hold B = 8
# requests of a 16-row tree
MAX_ROW_GROUPS = 8
KEEP_MAX = 16  # fused_experts: at most this many kept gate/up units (rendered: block.cuh MISC_KEEP)


def _fill_ring(p: Plan, smem_limit: int, norm_panel: int | None) -> Plan:
    """More stages of the tuned size in the shared memory the plan leaves free, up to RING_FILL_MAX
    stages and RING_FILL_BYTES of ring. Where staging the normed operand in panels (d_model halved,
    whole chunks of every NORM_OPS tile) frees a whole stage more, the fewest panels that do. A
    panel costs a barrier and a staging pass inside the GEMM, so panels are taken only for a stage."""
    if norm_panel is not None:
        cands = [norm_panel]
    else:
        kc = max(p.tiles[n].kc for n in NORM_OPS)
        cands, k = [0], p.cfg.d_model // 2
        while k >= kc and k % kc == 0 and p.cfg.d_model % k == 0:
            cands.append(k)
            k //= 2
    best = None
    for kp in cands:
        q = replace(p, norm_panel=kp)
        extra = 0  # a stage adds 16 bytes of mbarriers to misc_bytes too
        while q.ring_stages + extra < RING_FILL_MAX and (q.ring_stages + extra + 1) * q.stage_bytes <= RING_FILL_BYTES \
                and replace(q, ring_stages=q.ring_stages + extra + 1).smem_bytes <= smem_limit:
            extra += 1
        q = replace(q, ring_stages=q.ring_stages + extra, ring_fill=extra)
        if best is None or q.ring_stages > best.ring_stages:
            best = q
    return best


def make_plan(cfg: ModelConfig, n_sm: int, *, ring_stages: int = 4, ring_stage_bytes: int = 16384,
              spin_bound_ns: int = 2_000_000_000, poll_backoff_ns: int = 0, profile: bool = False,
              smem_limit: int = 232448, loader_ahead: bool = True, pdl: bool = False, profile_cap: int = 64,
              stream_evict_first: bool = False, sentinel_route: bool = False, keys_per_split: int = 32,
              fp4_rotated: bool = True, fill_ring: bool = False, norm_panel: int | None = None,
              profile_detail: bool = False, residual_unit_rows: int | None = None, tokens: int | None = None,
              expert1_rows: int | None = None, expert2_rows: int | None = None, layout_pad: int = 0,
              layout_gap: int = 0, fused_experts: bool = False, keep_max: int = KEEP_MAX,
              compute_registers: int = 0, launch_ranks: int = 1, tp_ranks: int = 0,
              expert_parallel: bool = False, row_groups: int = 1, union_experts: bool | None = None,
              merge_key_groups: bool = False) -> Plan:
    """fill_ring: add ring stages of the tuned size in the shared memory left free (the tuned ring
    is the smallest that streams at full rate with nothing else to do; the megakernel's consumers
    also compute, so deeper helps), staging the normed operand in panels where that frees a
    stage. norm_panel: force that panel width (tests), 0 = unpaneled. tokens: the tree size the
    build is for (default the config's max_tree; any step of up to max_tree tokens runs on it with
    the same bits: only the expert units follow it, expert1_unit_rows / expert2_unit_rows).
    residual_unit_rows, expert1_rows, expert2_rows: force the oproj / unpool and the expert unit
    rows (tests: the unit shapes of the presets' builds on a small model; default residual_rows,
    expert1_unit_rows, expert2_unit_rows). keep_max: at most this many kept gate/up units
    (fused_experts; tests: fewer kept units than a block runs). layout_pad: a code-layout placebo
    (Plan.layout_pad), a multiple of 16 bytes up to 64 KB; layout_gap: the same in the middle of
    the ops' code (Plan.layout_gap). compute_registers: Plan's (0 = off, or a multiple of 8 from
    176 to 232). launch_ranks, tp_ranks, expert_parallel, row_groups: Plan's. union_experts: Plan's, None = on with
    row groups (False there: the per-group ablation). merge_key_groups: Plan's. A TP build (tp_ranks >= 1) cuts
    oproj's K into max_tp_ranks(cfg) groups and sizes its expert units for that many ranks, so that
    its tiles, and so its bits, are the same at every R."""
    cfg.validate()
    if not (isinstance(launch_ranks, int) and launch_ranks >= 1):
        raise ValueError(f"launch_ranks {launch_ranks!r}: want a positive number of ranks per launch")
    if not (isinstance(row_groups, int) and 1 <= row_groups <= MAX_ROW_GROUPS):
        raise ValueError(f"row_groups {row_groups!r}: want 1..{MAX_ROW_GROUPS} groups of rows per step")
    if row_groups > 1 and (tp_ranks or launch_ranks > 1):
        raise ValueError(f"row_groups {row_groups}: row groups run on one rank (no tp_ranks, launch_ranks 1)")
    if union_experts is None:
        union_experts = row_groups > 1
    if union_experts and row_groups < 2:
        raise ValueError(f"union_experts: the union of row groups' routing needs row_groups >= 2 (got {row_groups})")
    ng = 0
    if tp_ranks or expert_parallel:
        why = tp_problem(cfg, tp_ranks) if isinstance(tp_ranks, int) and tp_ranks >= 1 else \
            f"tp_ranks {tp_ranks!r}: want 1, 2, 4 or 8 (expert_parallel is an arrangement of a TP build)"
        if why:
            raise ValueError(f"{cfg.name}: tensor parallelism: {why}")
        if fused_experts:
            raise ValueError("tensor parallelism runs the split expert GEMMs: the fused down projection is a K-part "
                             "of gate/up, which cannot be sharded on its output rows (fused_experts=False)")
        if launch_ranks not in (1, tp_ranks):
            raise ValueError(f"launch_ranks {launch_ranks}: a TP build of {tp_ranks} ranks launches one rank (one "
                             f"process per GPU) or all {tp_ranks} together")
        if expert_parallel and cfg.n_experts % tp_ranks:
            raise ValueError(f"expert_parallel: {cfg.n_experts} experts do not divide over {tp_ranks} ranks")
        ng = max_tp_ranks(cfg)
    if not (isinstance(compute_registers, int) and (compute_registers == 0 or (
            BASE_REGISTERS < compute_registers <= 232 and compute_registers % 8 == 0))):
        # 232: the loader's warpgroup keeps 40 (setmaxnreg takes multiples of 8 from 24 to 256)
        raise ValueError(f"compute_registers {compute_registers!r}: want 0 (off) or a multiple of 8 from 176 to 232")
    if not (isinstance(keep_max, int) and 0 <= keep_max <= KEEP_MAX):
        raise ValueError(f"keep_max {keep_max!r}: want 0..{KEEP_MAX} kept gate/up units")
    for name, v in (("layout_pad", layout_pad), ("layout_gap", layout_gap)):
        if not (isinstance(v, int) and 0 <= v <= 65536 and v % 16 == 0):
            raise ValueError(f"{name} {v!r}: want a multiple of 16 bytes from 0 to 65536 (one 16-byte instruction each)")
    if merge_key_groups not in (0, 1):  # True / False too
        raise ValueError(f"merge_key_groups {merge_key_groups!r}: want 0 or 1 (off / on)")
    c = cfg
    budget = ring_stage_bytes
    rr = residual_unit_rows or residual_rows(c, n_sm, budget)
    if c.d_model % rr or rr % DENSE_ROWS or (32 * WARPS) % rr:  # gemm_residual_add: one feature per thread
        raise ValueError(f"residual_unit_rows {rr}: must be a multiple of {DENSE_ROWS} dividing d_model "
                         f"{c.d_model} and the {32 * WARPS} compute threads")
    tiles = {
        "qkv": _tile(DENSE_ROWS, c.d_model, budget),
        # TP: a unit is one of the tp_groups K groups of oproj (its partial, the all-reduce's input)
        "oproj": _tile(rr, c.attn_width // ng if ng else c.attn_width, budget),
        "router": _tile(ROUTER_ROWS, c.d_model, budget),
        "pool": _tile(pool_rows(c, n_sm, budget), c.d_model, budget),
        "unpool": _tile(rr, c.d_pool, budget),
        "lm_head": _tile(16, c.d_model, budget),
    }
    # fp4 chunks may exceed the budget by their scales (1/8 of the codes): 256 rows x 256 columns of
    # codes fill a 36 KB stage at a 32 KB budget
    e1 = expert1_rows or expert1_unit_rows(c, n_sm, tokens or c.max_tree)
    # TP: units no larger than the share of the most ranks, the same at every R (a unit's rows set
    # how its warps accumulate: gemm_fp4), so that every R computes the same bits
    tiles["expert1"] = _expert_tile(min(e1, 2 * c.d_expert // (ng or 1)), c.d_pool, budget * 9 // 8, True)
    if fused_experts:  # chunks no larger than the other ops' (the ring's stage size stays theirs)
        tiles["expert2"] = _fused_down_tile(c, tiles["expert1"].rows // 2, max(t.stage_bytes for t in tiles.values()))
    else:
        # The split down projection (its own units of output rows over all of K) stays beside the
        # fused one: models whose shapes the fused unit does not take build it (tiny), and a
        # tensor-parallel build needs a down projection sharded on its output rows, which the fused
        # unit (a K-part of every output row) cannot give.
        e2 = expert2_rows or expert2_unit_rows(c, n_sm, tokens or c.max_tree)
        tiles["expert2"] = _expert_tile(min(e2, c.d_pool // (ng or 1)), c.d_expert, budget * 9 // 8, False)
    for op in ("expert1", "expert2"):
        tiles[op] = replace(tiles[op], rotated=fp4_rotated)
    if profile_detail and not profile:
        raise ValueError("profile_detail needs profile=True (the detail stamps are the profiler's)")
    p = Plan(cfg, n_sm, ring_stages, ring_stage_bytes, spin_bound_ns, poll_backoff_ns, profile=profile,
             loader_ahead=loader_ahead, pdl=pdl, profile_cap=profile_cap, stream_evict_first=stream_evict_first,
             sentinel_route=sentinel_route, keys_per_split=keys_per_split, profile_detail=profile_detail,
             fp4_rotated=fp4_rotated, tiles=tiles, layout_pad=layout_pad, layout_gap=layout_gap,
             fused_experts=fused_experts, compute_registers=compute_registers, launch_ranks=launch_ranks,
             tp_ranks=tp_ranks, tp_groups=ng, expert_parallel=expert_parallel, row_groups=row_groups,
             union_experts=union_experts, merge_key_groups=bool(merge_key_groups))
    if fill_ring or norm_panel is not None:
        if norm_panel and (c.d_model % norm_panel or any(norm_panel % tiles[n].kc for n in NORM_OPS)):
            raise ValueError(f"norm_panel {norm_panel}: must divide d_model {c.d_model} in whole chunks of "
                             f"{', '.join(f'{n} {tiles[n].kc}' for n in NORM_OPS)} columns")
        p = _fill_ring(p, smem_limit, norm_panel) if fill_ring else replace(p, norm_panel=norm_panel)
    if fused_experts:  # what the ring left: kept gate/up activations (Plan.keep_units)
        p = replace(p, keep_units=min(keep_max, max(0, (smem_limit - p.smem_bytes) // p.keep_unit_bytes)))
    if p.smem_bytes > smem_limit:
        raise KernelDoesNotFitError(
            f"megakernel for {cfg.name} needs {p.smem_bytes} B of shared memory per block (activations "
            f"{p.abuf_bytes}, ring {p.ring_stages} x {p.stage_bytes}, reduction {p.red_bytes}); the device "
            f"allows {smem_limit}. Use fewer/smaller ring stages.")
    f_sh, p_sh = p.expert_rows
    for name, t in tiles.items():
        n = {"qkv": p.rcfg.qkv_rows, "oproj": c.d_model, "router": c.n_experts, "pool": c.d_pool, "unpool": c.d_model,
             "lm_head": c.vocab, "expert1": 2 * f_sh, "expert2": p_sh}[name]
        if n % t.rows:
            raise ValueError(f"{name}: {n} output rows not a multiple of the {t.rows}-row tile")
    if c.head_dim % 8 or c.qkv_rows % 8:
        raise ValueError("head_dim must be a multiple of the 8-row qkv tile (tiles never straddle heads)")
    return p


def render(plan: Plan) -> str:
    """The C++ constants header (prepended to the kernel source)."""
    c, rc = plan.cfg, plan.rcfg  # rc: the heads one rank holds (tp_ranks), else the model's
    f_sh, p_sh = plan.expert_rows
    recv = plan.recv_layout
    lines = [
        "// GENERATED by megakernel/plan.py:render() from the model config and tuned constants. Do not edit.",
        "#pragma once",
        f"#define MB_PROFILE {int(plan.profile)}",
        '#include "mb/types.cuh"',
        "namespace mk {",
        f"// model {c.name}",
        f"constexpr int D = {c.d_model};",
        f"constexpr int V = {c.vocab};",
        f"constexpr int L = {c.n_layers};",
        f"constexpr int HQ = {rc.n_heads};  // a rank's (Plan.rcfg)",
        f"constexpr int HKV = {rc.n_kv_heads};",
        f"constexpr int HD = {c.head_dim};",
        f"constexpr int G = {c.group};",
        f"constexpr int QKV_ROWS = {rc.qkv_rows};",
        f"constexpr int ATT_W = {rc.attn_width};",
        f"constexpr int E = {c.n_experts};",
        f"constexpr int TOPK = {c.top_k};",
        f"constexpr int P = {c.d_pool};",
        f"constexpr int F = {c.d_expert};",
        f"constexpr int F_SH = {f_sh}, P_SH = {p_sh};  // a rank's gate rows and down-projection rows per expert",
        f"constexpr int WINDOW = {c.window};",
        f"constexpr int RING_SLOTS = {c.ring_slots};",
        f"constexpr int MAX_CTX = {c.max_context};",
        f"constexpr int T_MAX = {c.max_tree};",
        f"constexpr float RMS_EPS = {c.rms_eps!r}f;",
        f"constexpr float ATT_SCALE = {c.head_dim ** -0.5!r}f;",
        f"constexpr int MAX_SLOTS = {plan.max_slots};",
        f"constexpr int MAX_SPLITS = {plan.max_splits};",
        f"constexpr int KEYS_PER_SPLIT = {plan.keys_per_split};",
        f"constexpr int ATT_KB = {plan.attn_round_keys};  // keys attention stages per round",
        f"constexpr int MOE_COMBINE_COLS = {MOE_COMBINE_COLS};",
        "// launch shape",
        f"constexpr int WARPS = {WARPS};",
        f"constexpr int THREADS = {plan.threads};",
        f"constexpr int COMPUTE_REGS = {plan.compute_registers};  // per-role budgets (Plan.compute_registers; 0 = off)",
        f"constexpr int LOADER_REGS = {plan.loader_registers};",
        f"constexpr int COMPUTE_THREADS = {32 * WARPS};",
        "// ranks (Plan.launch_ranks, tp_ranks, tp_groups, expert_parallel)",
        f"constexpr int RANKS_PER_LAUNCH = {plan.launch_ranks};",
        f"constexpr int GROUPS = {plan.row_groups};  // row groups of a step (Plan.row_groups)",
        f"constexpr bool UNION_EXPERTS = {'true' if plan.union_experts else 'false'};  // Plan.union_experts",
        f"constexpr int MAX_USLOTS = {max(plan.max_uslots, 1)};  // union slots (Plan.max_uslots; 1 without)",
        f"constexpr int TP = {plan.tp_ranks}, TP_GROUPS = {plan.tp_groups or 1};",
        f"constexpr bool EXPERT_PARALLEL = {'true' if plan.expert_parallel else 'false'};",
        f"constexpr unsigned long long RECV_AR = {recv.get('ar', (0, 0))[0]}ull, RECV_ACT = {recv.get('act', (0, 0))[0]}ull, "
        f"RECV_Y = {recv.get('y', (0, 0))[0]}ull, RECV_BYTES = {plan.recv_bytes}ull;",
        f"constexpr int ROW_PAD = {ROW_PAD};",
        "// ring (tuned constants: weights.ring) and smem carve-up",
        f"constexpr int RING_STAGES = {plan.ring_stages};",
        f"constexpr int STAGE_BYTES = {plan.stage_bytes};",
        f"constexpr int ABUF_BYTES = {plan.abuf_bytes};",
        f"constexpr int NORM_KP = {plan.norm_k};  // columns of a normed operand staged at a time",
        f"constexpr int XG_ROW = {plan.xg_row};  // bf16 per row of xg (gemm.cuh xg_at), the pad included",
        f"constexpr int RED_BYTES = {plan.red_bytes};",
        f"constexpr int SMEM_BYTES = {plan.smem_bytes};",
        "// synchronisation (tuned constants: sync.flags)",
        f"constexpr unsigned long long SPIN_BOUND_NS = {plan.spin_bound_ns}ull;",
        f"constexpr unsigned POLL_BACKOFF_NS = {plan.poll_backoff_ns}u;",
        "// op kinds",
        "enum OpKind : int { " + ", ".join(f"OP_{k.upper()} = {i}" for i, k in enumerate(OP_KINDS)) + " };",
        f"constexpr int OP_KINDS = {len(OP_KINDS)};",
        f"constexpr unsigned UNION_SHARED_MASK = {sum(1 << OP[k] for k in UNION_SHARED)}u;  // plan.UNION_SHARED",
        "// GEMM tiles: rows per unit, K chunk, K",
    ]
    for name, t in plan.tiles.items():
        u = name.upper()
        lines += [f"constexpr int TILE_{u}_ROWS = {t.rows};", f"constexpr int TILE_{u}_KC = {t.kc};",
                  f"constexpr int TILE_{u}_K = {t.k};", f"constexpr int TILE_{u}_SW = {t.swizzle};"]
    lines += [
        "static_assert(HQ % HKV == 0, \"GQA group\");",
        "static_assert(HD % 16 == 0 && HD % TILE_QKV_ROWS == 0, \"qkv tiles never straddle heads\");",
        "static_assert(T_MAX <= 16, \"one m16 tile of tokens\");",
        "static_assert(D % 64 == 0 && P % 64 == 0 && F % 64 == 0, \"k-steps\");",
        "static_assert(STAGE_BYTES % 16 == 0 && ABUF_BYTES % 16 == 0, \"bulk-copy alignment\");",
        "static_assert(G <= WARPS && WARPS % G == 0, \"attention: one warp group per q head\");",
        f"static_assert(TILE_QKV_ROWS == {DENSE_ROWS} && TILE_OPROJ_ROWS % {DENSE_ROWS} == 0 && TILE_ROUTER_ROWS == "
        f"{ROUTER_ROWS} && TILE_POOL_ROWS % {DENSE_ROWS} == 0 && TILE_UNPOOL_ROWS % {DENSE_ROWS} == 0 && "
        "TILE_LM_HEAD_ROWS == 16, "
        "\"unit rows match program.py's unit counts\");",
        f"static_assert(SMEM_BYTES <= 232448, \"fits the opt-in shared memory of sm_90\");",
        f"constexpr int PROFILE = {int(plan.profile)};",
        f"constexpr int PROFILE_DETAIL = {int(plan.profile and plan.profile_detail)};",
        f"constexpr int LOADER_AHEAD = {int(plan.loader_ahead)};",
        f"constexpr int PDL = {int(plan.pdl)};",
        f"constexpr bool STREAM_EVICT_FIRST = {'true' if plan.stream_evict_first else 'false'};",
        f"constexpr bool SENTINEL_ROUTE = {'true' if plan.sentinel_route else 'false'};",
        f"constexpr int LAYOUT_PAD = {plan.layout_pad};  // never-run bytes ahead of the kernel's body",
        f"constexpr int LAYOUT_GAP = {plan.layout_gap};  // never-run bytes in the middle of the ops' code",
        f"constexpr bool FUSED_EXPERTS = {'true' if plan.fused_experts else 'false'};",
        f"constexpr int KEEP_UNITS = {plan.keep_units}, KEEP_BYTES = {plan.keep_bytes}, KEEP_MAX = {KEEP_MAX};  // fused: kept gate/up units",
        f"constexpr int MISC_BYTES = {plan.misc_bytes};  // mbarriers + MISC ints (Plan.misc_bytes)",
        f"constexpr int PROF_OPS = {PROF_OPS}, MISC_SCRATCH = {MISC_SCRATCH};  // block.cuh's MISC layout",
        f"constexpr unsigned long long GLOBAL_MASK = {sum(1 << g for g in c.global_layers)}ull;  // bit l: layer l is global",
        f"constexpr int PARTS = {plan.attn_parts};  // attention partials per kv head (MAX_SPLITS x ATT_PPS)",
        f"constexpr int ATT_PPS = {plan.attn_partials_per_split};  // partials a split writes (Plan.merge_key_groups)",
        "}  // namespace mk",
    ]
    return "\n".join(lines) + "\n"
