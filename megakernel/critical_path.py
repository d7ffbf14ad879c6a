"""A critical-path model of one megakernel layer, from the committed H200 results.

A layer launch (attention of layer l through the qkv projection of layer l + 1) is a chain of
dependent ops; the router and the pooler are the one pair that runs side by side. For each op and
each hop between two ops the model puts its predicted bound beside its measured time:

  bytes    the op's HBM bytes (weights, KV rows) at the read ceiling (weights.read_ceiling),
           the roofline's view of the op;
  compute  the expert GEMMs' k-loop: a block's chunks x a chunk's measured compute (the detail
           trace: from one ring wait's end to the next one's begin, within a unit);
  hop      what a dependency costs: the producer's slowest block (end tail, derived in the
           timeline) and the flag latency (sync.flags) between the producer's last store and the
           consumer's start; inside the ops, the producer's release fence (the detail trace's
           publish spans) and the consumer's first staging round trip (its first stage span).
           Removing a hop saves all four (HOP_PARTS).

Measured: the median over blocks of each op phase's start and end in the middle layer launch of
the committed `megakernel.timeline` result (shard8 T=16 ctx 2048, the point `megabench run`
traces), the op durations and the gaps between them (a hop's time is the consumer's start minus
its producer's end; a parallel pair's consumer counts from the later producer). The rows sum to
the layer launch's period; `spans.layer_segments` (derived layer_front_s, ...) cuts the same
launch at the first gate/up start and the last down-projection end (over blocks, not medians),
so its segments differ from the rows' sums by the blocks' spread.

`levers()` turns the rows into the predicted saving of each structural change not built yet, with
the arithmetic it rests on; `table()` renders both as markdown (the report calls it). Every number
is read from the results and the tuned constants, none typed in here. What a built lever measured
is in its in-run A/B (megakernel.ab) and reports/LEVERS.md, not here.
"""
from __future__ import annotations

import gzip
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from microbench.errors import ResultsFileError
from microbench.results import REPO_ROOT, latest

from .config import preset as get_preset
from .roofline import kv_row_bytes, kv_rows_read, roofline

# a layer launch's ops in program order (program.build), and each op's producers in that launch
CHAIN = ("attn", "attn_combine", "oproj", "router", "pool", "topk", "expert1", "expert2", "moe_combine", "unpool",
         "qkv")
PRODUCERS = {"attn_combine": ("attn",), "oproj": ("attn_combine",), "router": ("oproj",), "pool": ("oproj",),
             "topk": ("router",), "expert1": ("topk", "pool"), "expert2": ("expert1",),
             "moe_combine": ("expert2",), "unpool": ("moe_combine",), "qkv": ("unpool",)}
SEGMENT = {"attn": "front", "attn_combine": "front", "oproj": "front", "router": "front", "pool": "front",
           "topk": "front", "expert1": "experts", "expert2": "experts", "moe_combine": "back", "unpool": "back",
           "qkv": "back"}
HOP_PARTS = ("release", "flag", "stage", "tail")
INSN_BYTES = 16  # an sm_90 instruction
# the source file (csrc/ops/<name>.cuh) each op of the chain is built from (build.op_of_chain)
OP_SOURCE = {"attn": "attention", "attn_combine": "attn_combine", "oproj": "oproj", "router": "router", "pool": "pool",
             "topk": "topk", "expert1": "expert_gemm1", "expert2": "expert_gemm2", "moe_combine": "moe_combine",
             "unpool": "unpool", "qkv": "qkv_rope"}
TIMELINE_POINT = ("shard8", 16, 2048)  # pipeline.run traces QUICK["shard8"][-1]


@dataclass(frozen=True)
class Inputs:
    """Every number the model uses; `sources` says where each came from."""
    preset: str
    n_tokens: int
    ctx: int
    n_sm: int
    distinct: int  # experts the step's layer routes to
    ceiling: float  # B/s
    l2_rate: float  # B/s, the whole GPU's L2 read bandwidth
    flag_s: float
    fence_s: float  # the release fence under load (sync.fences), beside the kernel's own publish_s
    publish_s: float  # the kernel's release at an op's end (median publish span)
    stage_s: dict  # op -> its first staging round trip (median first stage span)
    chunk_s: dict  # expert1 / expert2 -> a chunk's compute
    edges: dict  # op -> (start, end) s, medians over blocks, the middle launch
    end_tail_s: dict  # op -> last block's end minus the median block's
    segments_s: dict  # spans.layer_segments of the timeline result
    step_s: float  # the unprofiled step the timeline timed
    roofline_s: float
    launches: int
    sources: dict = field(default_factory=dict, compare=False)
    # cold code (megakernel.code, icache.capacity): each op's machine code, the kernel's, the
    # SM's instruction cache, the cycles an instruction takes served from L2 (the 1-warp curve's
    # last plateau) and inside the SM's cache, and the SM clock the timeline ran at
    code_bytes: dict = field(default_factory=dict)  # CHAIN op -> bytes ("schedule" too)
    kernel_code_bytes: int = 0
    icache_bytes: int = 0
    l2_cpi: float = 0.0
    sm_cpi: float = 0.0
    clock_hz: float = 0.0
    # the per-op account of Nsight Compute at the middle launch (ncu_ops: the newest
    # ncu-mega-<preset>-L<launch>-*-stalls.md with a per-op table that splits the copy waits off):
    # CHAIN op -> its row (samples, copy_wait, own, own_no_inst, own_long_sb as ints or percent
    # numbers, own_top3); {} when there is none
    ncu_ops: dict = field(default_factory=dict)

    def code_s(self, op: str, cpi: float | None = None) -> float:
        """One pass over the op's code at `cpi` cycles an instruction (default: served from L2)."""
        if not self.clock_hz:
            return 0.0
        return self.code_bytes.get(op, 0) / INSN_BYTES * (self.l2_cpi if cpi is None else cpi) / self.clock_hz

    def layer_code_bytes(self) -> int:
        """The code a block runs in one layer launch: every op of the chain and the schedule."""
        return sum(self.code_bytes.get(op, 0) for op in (*CHAIN, "schedule"))

    @property
    def layer_s(self) -> float:
        return self.step_s / self.launches

    @property
    def roofline_layer_s(self) -> float:
        return self.roofline_s / self.launches


@dataclass(frozen=True)
class Row:
    segment: str
    item: str  # an op, or "a -> b" for a hop
    measured_s: float
    bytes: int = 0
    bytes_s: float = 0.0
    compute_s: float = 0.0
    hop_s: float = 0.0  # tail + flag (a hop row); release + stage inside an op row
    note: str = ""
    code_s: float = 0.0  # one pass over the op's code served from L2 (not in bound_s: a candidate term)

    @property
    def bound_s(self) -> float:
        """The row's predicted floor: the larger of its bytes and its compute, plus its latency."""
        return max(self.bytes_s, self.compute_s) + self.hop_s

    @property
    def excess_s(self) -> float:
        return self.measured_s - self.bound_s


@dataclass(frozen=True)
class Lever:
    name: str
    segment: str
    saving_s: float  # per layer launch
    how: str  # the arithmetic
    # levers that end at the same bound (the pooler's last block, for the front's) do not add up:
    # together they save the largest of them (combined_saving_s)
    limit: str = ""

    def step_after_s(self, inp: Inputs) -> float:
        return inp.step_s - self.saving_s * inp.launches


# ---------------------------------------------------------------------------------- inputs
def _latest(benchmark: str, root: Path | None, gpu: str | None = None):
    """The newest `benchmark` result (of `gpu` where given: the model's inputs are one GPU's)."""
    r = latest(benchmark, root=root or REPO_ROOT / "reports" / "results", gpu=gpu)
    if r is None:
        raise ResultsFileError(f"critical path: no {benchmark} result{' of ' + gpu if gpu else ''} under "
                               f"{root or 'reports/results'}")
    return r


def _trace_spans(detail, root: Path | None) -> dict:
    """{(launch, block): [(name, begin_us, dur_us, arg)]} of the detail result's Perfetto trace."""
    name = next((n.split(": ", 1)[1].split(";")[0] for n in detail.notes if n.startswith("Perfetto trace")), None)
    base = (root or REPO_ROOT / "reports" / "results") / "megakernel"
    path = base / f"{name}.gz" if name and (base / f"{name}.gz").exists() else base / (name or "")
    if not name or not path.is_file():
        raise ResultsFileError(f"critical path: the detail timeline's trace {name!r} is not under {base}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            out[(e["pid"], e["tid"])].append((e["name"], float(e["ts"]), float(e["dur"]), e.get("args", {}).get("arg")))
    for v in out.values():
        v.sort(key=lambda s: s[1])
    return out


def _trace_medians(spans: dict) -> tuple[float, dict, dict]:
    """From the detail trace: the median publish span, each op's median first staging span
    (stage, or attention's attn_load), and the expert GEMMs' median chunk compute (the gap between
    consecutive ring waits of one unit, chunks c and c + 1, nothing stamped between), in seconds."""
    pub, stage, chunk = [], defaultdict(list), defaultdict(list)
    for sp in spans.values():
        ops = [s for s in sp if s[0] in CHAIN]
        for o in ops:
            inside = [s for s in sp if o[1] <= s[1] < o[1] + o[2] and s is not o]
            first = next((s for s in inside if s[0] in ("stage", "attn_load")), None)
            if first:
                stage[o[0]].append(first[2])
            pub += [s[2] for s in inside if s[0] == "publish"]
            if o[0] in ("expert1", "expert2"):
                for k, (a, b) in enumerate(zip(inside, inside[1:])):
                    if a[0] == b[0] == "ring_wait" and a[3] is not None and b[3] == a[3] + 1:
                        chunk[o[0]].append(b[1] - (a[1] + a[2]))
    us = 1e-6
    return (statistics.median(pub) * us, {k: statistics.median(v) * us for k, v in stage.items()},
            {k: statistics.median(v) * us for k, v in chunk.items()})


def inputs(root: Path | None = None) -> Inputs:
    """The model's inputs from the latest committed megakernel.timeline / timeline_detail results
    (and the detail trace they name), sync.flags, sync.fences, weights.l2, weights.read_ceiling
    and megakernel.step under `root` (default reports/results)."""
    from .bench_baselines import study_like_distinct  # heavy: torch (megakernel.bench_baselines)
    from .plans import middle_launch  # heavy: torch (megakernel.plans)

    # every input from the GPU of the newest detail timeline (the model's subject): a newer run on
    # another GPU (a build, a step) must not mix into its rows
    detail = _latest("megakernel.timeline_detail", root)
    gpu = detail.env.gpu
    tl = _latest("megakernel.timeline", root, gpu)
    flags, fences = _latest("sync.flags", root, gpu), _latest("sync.fences", root, gpu)
    l2 = _latest("weights.l2", root, gpu)
    rc = _latest("weights.read_ceiling", root, gpu)
    preset, t, ctx = TIMELINE_POINT
    cfg = get_preset(preset)
    distinct = study_like_distinct(cfg, t)
    ceiling = rc.derived["read_ceiling_bytes_per_s"].value
    edges = {}
    for s in tl.series:
        ph, edge = s.params.get("phase"), s.params.get("edge")
        if ph in CHAIN and edge in ("start", "end"):
            edges.setdefault(ph, {})[edge] = s.summary.median
    edges = {k: (v["start"], v["end"]) for k, v in edges.items()}
    missing = [op for op in CHAIN if op not in edges]
    if missing:
        raise ResultsFileError(f"critical path: the timeline result has no phases {missing}")
    spans = _trace_spans(detail, root)
    pub, stage, chunk = _trace_medians(spans)
    code = cold_code_inputs(root, preset, t, tl)
    launches = cfg.n_layers + 1  # program.build, layer mode
    rf = roofline(cfg, t, ctx, distinct, ceiling=(ceiling, "weights.read_ceiling"))
    step = next(s.summary.median for s in tl.series if s.name == f"profiler_cost/{preset}/off")
    n_sm = int(tl.env.sm_count or 132)
    ncu = ncu_ops(root, preset, middle_launch(launches))
    return Inputs(
        preset, t, ctx, n_sm, distinct, ceiling,
        l2.derived["l2_bandwidth_bytes_per_s"].value, flags.derived["flag_latency_s"].value,
        fences.derived["fence_acq_rel_gpu_loaded_s"].value, pub, stage, chunk, edges,
        {k[len("end_tail_"):-2]: v.value for k, v in tl.derived.items() if k.startswith("end_tail_")},
        {k[len("layer_"):-2]: v.value for k, v in tl.derived.items() if k.startswith("layer_") and k.endswith("_s")},
        step, rf.seconds, launches,
        code_bytes=code.get("code_bytes", {}), kernel_code_bytes=code.get("kernel_code_bytes", 0),
        icache_bytes=code.get("icache_bytes", 0), l2_cpi=code.get("l2_cpi", 0.0), sm_cpi=code.get("sm_cpi", 0.0),
        clock_hz=code.get("clock_hz", 0.0), ncu_ops=ncu.get("ops", {}),
        sources={**code.get("sources", {}), **ncu.get("sources", {}),
                 **({"code_stale": code["stale"]} if "stale" in code else {}),
                 "timeline": f"megakernel.timeline {tl.env.date} {tl.env.git_sha[:7]} (launch "
                             f"{middle_launch(launches)} of {launches}, medians over blocks)",
                 "detail": f"megakernel.timeline_detail {detail.env.date} {detail.env.git_sha[:7]} and its trace",
                 "flag": f"sync.flags flag_latency_s {flags.env.date}",
                 "fence": f"sync.fences fence_acq_rel_gpu_loaded_s {fences.env.date}",
                 "l2": f"weights.l2 l2_bandwidth_bytes_per_s {l2.env.date}",
                 "ceiling": f"weights.read_ceiling read_ceiling_bytes_per_s {rc.env.date}"})


NCU_STALLS = re.compile(r"ncu-mega-(?P<preset>\w+)-L(?P<launch>\d+)-(?P<stamp>\d{8}T\d{4,6}Z)-(?P<sha>[0-9a-f]+)-stalls\.md")


def _md_table(lines: list[str]) -> list[dict]:
    """The rows of the first pipe table in `lines` (header, separator, rows) as dicts of stripped cells."""
    rows = [ln for ln in lines if ln.startswith("|")]
    if len(rows) < 2:
        return []
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in r.strip("|").split("|")))) for r in rows[2:]]


def ncu_ops(root: Path | None, preset: str, launch: int) -> dict:
    """The per-op account of the newest Nsight Compute stall summary of this launch (the
    `## Per op` table that `megabench mk ncu-stalls --preset` writes, with its copy waits split
    off: ncu_stalls.by_op): {"ops": {CHAIN op: row}, "sources": {"ncu": file}}, or {} when no
    summary of the launch has that table (older ones only counted samples per op)."""
    base = (root or REPO_ROOT / "reports" / "results") / "megakernel"
    found = sorted((m.group("stamp"), p) for p in base.glob("ncu-mega-*-stalls.md")
                   if (m := NCU_STALLS.fullmatch(p.name)) and m.group("preset") == preset
                   and int(m.group("launch")) == launch)
    for _, path in reversed(found):
        text = path.read_text().splitlines()
        at = next((i for i, ln in enumerate(text) if ln.startswith("## Per op")), None)
        if at is None:
            continue
        table = _md_table(text[at + 1:])
        if not table or "copy_wait" not in table[0]:
            continue
        by_src = {r["op"]: r for r in table}
        ops = {}
        for op, src in OP_SOURCE.items():
            r = by_src.get(src)
            if r is None:
                continue
            try:
                ops[op] = {"samples": int(r["samples"]), "copy_wait": int(r["copy_wait"]), "own": int(r["own"]),
                           "own_no_inst": float(r["own_no_inst"].rstrip("%") or 0),
                           "own_long_sb": float(r["own_long_sb"].rstrip("%") or 0), "own_top3": r["own_top3"]}
            except (KeyError, ValueError) as e:
                raise ResultsFileError(f"critical path: {path.name}: the per-op row of {src!r} is malformed ({e})")
        return {"ops": ops, "sources": {"ncu": f"{path.name} (Nsight Compute, launch {launch})"}}
    return {}


def cold_code_inputs(root: Path | None, preset: str, tokens: int, tl) -> dict:
    """The cold-code inputs: megakernel.code's bytes per op at (preset, tokens), checked against
    the H200's own megakernel.build (the same kernel, or the code result is stale: {"stale": why}),
    and the instruction-cache levels of icache.capacity. {} when there is no megakernel.code result."""
    base = root or REPO_ROOT / "reports" / "results"
    code = latest("megakernel.code", root=base)
    if code is None:
        return {}
    mine = [s for s in code.series if s.params.get("preset") == preset and s.params.get("tokens") == tokens]
    if not mine:
        raise ResultsFileError(f"critical path: the megakernel.code result of {code.env.date} has no {preset} "
                               f"T={tokens} build (`megabench mk code --point {preset}:{tokens} --save`)")
    by_src = {s.params["op"]: int(s.summary.median) for s in mine}
    total = int(mine[0].metrics["kernel_code_bytes"])
    build = _latest("megakernel.build", root, tl.env.gpu)
    ran = next((int(s.metrics["code_bytes"]) for s in build.series if s.name == f"build/{preset}"), None)
    if ran != total:  # a kernel changed since: the column is left out, saying why (render)
        return {"stale": f"megakernel.code ({code.env.git_sha[:7]}, {code.env.date}) has a {total} B kernel but the "
                         f"GPU's megakernel.build ({build.env.git_sha[:7]}, {build.env.date}) ran {ran} B: the code "
                         "result is stale (`megabench mk code --save`)"}
    ic = _latest("icache.capacity", root, tl.env.gpu)
    levels = sorted((k, d.value) for k, d in ic.derived.items() if re.fullmatch(r"icache_plateau\d+_cpi_w1", k))
    if not levels or "icache_sm_miss_cpi_w1" not in ic.derived or "icache_sm_bytes" not in ic.derived:
        raise ResultsFileError(f"critical path: icache.capacity of {ic.env.date} resolved no instruction-cache levels")
    l2_cpi = max(v for _, v in levels)  # the last plateau: code served from L2
    sm_cpi = l2_cpi - ic.derived["icache_sm_miss_cpi_w1"].value
    mhz = tl.env.sm_clock_max_mhz or ic.env.sm_clock_max_mhz
    out = {op: by_src.get(src, 0) for op, src in OP_SOURCE.items()}
    out["schedule"] = by_src.get("schedule", 0)
    return {"code_bytes": out, "kernel_code_bytes": total, "icache_bytes": int(ic.derived["icache_sm_bytes"].value),
            "l2_cpi": l2_cpi, "sm_cpi": sm_cpi, "clock_hz": mhz * 1e6,
            "sources": {"code": f"megakernel.code {code.env.date} {code.env.git_sha[:7]} (NVRTC {code.env.nvrtc}; "
                                f"the kernel's {total} B equal to megakernel.build {build.env.date} on the GPU)",
                        "icache": f"icache.capacity {ic.env.date} (L2-served {l2_cpi:.2f} cycles/instr, SM cache "
                                  f"{sm_cpi:.2f}; clock {mhz} MHz)"}}


# ---------------------------------------------------------------------------------- the rows
def op_bytes(inp: Inputs) -> dict[str, int]:
    """HBM bytes of each op of the middle layer launch (attention of layer l, qkv of l + 1)."""
    from .plans import middle_launch  # heavy: torch (megakernel.plans)

    c = get_preset(inp.preset)
    layer = middle_launch(inp.launches) - 1
    d = c.d_model
    w1 = 2 * c.d_expert * c.d_pool  # gate/up parameters of an expert; the down projection has half
    frac1 = w1 / c.expert_params
    return {"attn": kv_rows_read(c, layer, inp.n_tokens, inp.ctx) * kv_row_bytes(c),
            "attn_combine": 0, "oproj": 2 * d * c.attn_width + 2 * d, "router": 2 * c.n_experts * d,
            "pool": 2 * c.d_pool * d, "topk": 0,
            "expert1": round(inp.distinct * c.expert_bytes * frac1),
            "expert2": round(inp.distinct * c.expert_bytes * (1 - frac1)), "moe_combine": 0,
            "unpool": 2 * d * c.d_pool + 2 * d, "qkv": 2 * c.qkv_rows * d + inp.n_tokens * kv_row_bytes(c)}


def expert_chunks_per_block(inp: Inputs) -> dict[str, int]:
    """The most chunks a block streams in each expert GEMM (its units x a unit's chunks), for the
    build the timeline ran (plans.plan_for with the tuned constants, tokens = T)."""
    from .plans import plan_for, slot_units  # heavy: torch (megakernel.plans)

    plan = plan_for(inp.preset, None, inp.n_sm, tokens=inp.n_tokens)
    per_slot = slot_units(plan)
    out = {}
    for op in ("expert1", "expert2"):
        units = inp.distinct * per_slot[op]
        t = plan.tiles[op]
        chunks = (inp.distinct and (plan.cfg.d_pool // t.rows if op == "expert2" and plan.fused_experts
                                    else t.chunks))
        out[op] = -(-units // inp.n_sm) * chunks
    return out


def rows(inp: Inputs) -> list[Row]:
    """One row per op and per hop of the middle layer launch, in chain order."""
    b = op_bytes(inp)
    chunks = expert_chunks_per_block(inp)
    e = inp.edges
    out = []
    for op in CHAIN:
        prods = PRODUCERS.get(op, ())
        if prods:
            last = max(prods, key=lambda p: e[p][1])
            local = op == "expert2"  # fused: DEP_LOCAL, the block's own gate/up units (no grid hop)
            tail = 0.0 if local else inp.end_tail_s.get(last, 0.0)
            seg = "front" if op == "expert1" else SEGMENT[op]  # the front ends where gate/up starts
            out.append(Row(seg, f"{last} -> {op}", e[op][0] - e[last][1], hop_s=tail + (0.0 if local else inp.flag_s),
                           note="the block's own units (fused experts)" if local else
                           f"{last}'s end tail {tail * 1e6:.2f} us + flag {inp.flag_s * 1e6:.2f} us"))
        compute = chunks[op] * inp.chunk_s[op] if op in chunks else 0.0
        lat = inp.stage_s.get(op, 0.0) + (inp.publish_s if op != "expert1" else 0.0)
        note = []
        if op in chunks:
            note.append(f"{chunks[op]} chunks a block x {inp.chunk_s[op] * 1e6:.3f} us")
        if op in inp.stage_s:
            note.append(f"first staging {inp.stage_s[op] * 1e6:.2f} us")
        if op != "expert1":
            note.append(f"release {inp.publish_s * 1e6:.2f} us")
        out.append(Row(SEGMENT[op], op, e[op][1] - e[op][0], b[op], b[op] / inp.ceiling, compute, lat,
                       "; ".join(note), inp.code_s(op)))
    return out


def segment_rows(rs: Sequence[Row]) -> list[Row]:
    """Per segment: the sums of its rows along the critical path (the pooler, beside the router,
    only where it is the later producer: its hop row already counts from it)."""
    out = []
    for seg in ("front", "experts", "back"):
        mine = [r for r in rs if r.segment == seg and not _off_path(r, rs)]
        out.append(Row(seg, f"{seg} (sum)", sum(r.measured_s for r in mine), sum(r.bytes for r in mine),
                       sum(r.bytes_s for r in mine), sum(r.compute_s for r in mine), sum(r.hop_s for r in mine),
                       f"{sum(1 for r in mine if '->' in r.item)} hops", sum(r.code_s for r in mine)))
    return out


def _off_path(r: Row, rs: Sequence[Row]) -> bool:
    """The side of the router / pooler pair that ends first is off the critical path (its op and
    the hops into and out of it)."""
    router_side, pool_side = ("oproj -> router", "router", "router -> topk", "topk"), ("oproj -> pool", "pool")
    if r.item not in router_side + pool_side:
        return False
    by = {x.item: x for x in rs}
    topk_path = by["oproj -> router"].measured_s + by["router"].measured_s + by["router -> topk"].measured_s + \
        by["topk"].measured_s
    pool_path = by["oproj -> pool"].measured_s + by["pool"].measured_s
    return (r.item in pool_side) == (topk_path >= pool_path)


# ---------------------------------------------------------------------------------- the levers
def hop_cost_s(inp: Inputs, producer: str, consumer: str) -> float:
    """What removing the hop producer -> consumer saves (HOP_PARTS): the producer's release and
    end tail, the flag, the consumer's first staging round trip."""
    return inp.publish_s + inp.end_tail_s.get(producer, 0.0) + inp.flag_s + inp.stage_s.get(consumer, 0.0)


def levers(inp: Inputs, rs: Sequence[Row] | None = None) -> list[Lever]:
    """The structural changes not built yet, largest predicted saving per layer first."""
    from .plans import plan_for  # heavy: torch (megakernel.plans)

    c = get_preset(inp.preset)
    rs = rs or rows(inp)
    by = {r.item: r for r in rs}
    plan = plan_for(inp.preset, None, inp.n_sm, tokens=inp.n_tokens)
    l2_sm = inp.l2_rate / inp.n_sm
    parts = c.d_expert // (plan.tiles["expert1"].rows // 2)
    token_partials = c.top_k * parts * c.d_pool * 4
    out = [
        Lever("top-k computed by every gate/up block from the router logits", "front",
              inp.edges["expert1"][0] - max(inp.edges["pool"][1] + inp.end_tail_s.get("pool", 0.0) + inp.flag_s,
                                            inp.edges["topk"][1] - inp.publish_s),
              "gate/up starts when the later of the pooler's last block (+ flag) and the router + top-k's own "
              "steps end: top-k's release, the gate/up blocks' acquire of it and its hop go", limit="pool"),
        Lever("router in two K-halves on the SMs the router and pooler leave idle", "front",
              _router_halves_saving(inp, by),
              "a half unit stages one panel of the normed operand and streams half the chunks (its other time "
              f"halves: {by['router'].measured_s * 1e6:.2f} -> {_router_half_s(inp, by) * 1e6:.2f} us), top-k adds the "
              "two halves in a fixed order; gate/up then starts when the later of that path and the pooler's "
              "(+ its end tail and the flag) ends", limit="pool"),
        Lever("qkv over all SMs (units of 8 rows where that takes fewer bytes a block)", "back",
              _spread_saving(inp, plan, "qkv", by["qkv"]),
              f"{c.qkv_rows // plan.tiles['qkv'].rows} units of {plan.tiles['qkv'].rows} rows on {inp.n_sm} SMs; "
              "8-row units (the smallest bf16 tile) in as many rounds as the grid needs: the op's streaming part "
              "shrinks with a block's bytes, if a block streams at its share of the ceiling"),
        Lever("MoE combine folded into the down projection's last finisher per token", "back",
              by["expert2 -> moe_combine"].measured_s + by["moe_combine"].measured_s
              + by["moe_combine -> unpool"].measured_s - (token_partials / l2_sm + inp.publish_s + inp.flag_s
                                                          + inp.end_tail_s.get("expert2", 0.0)),
              f"saves the hop, the op and its hop, but a token's last finisher reads its {c.top_k} x {parts} fp32 "
              f"partials ({token_partials / 1e3:.0f} KB) alone at 1/{inp.n_sm} of the L2 rate "
              f"({token_partials / l2_sm * 1e6:.1f} us), then releases"),
        Lever("attention split-K with a last-finisher combine", "front",
              hop_cost_s(inp, "attn", "attn_combine") + by["attn_combine"].measured_s
              - _combine_alone_s(inp, plan, l2_sm),
              "saves the hop and the combine op, but the last split of a kv head merges all its "
              f"{c.group * inp.n_tokens} query rows' partials alone"),
    ]
    return sorted(out, key=lambda lv: -lv.saving_s)


def combined_saving_s(lvs: Sequence[Lever]) -> float:
    """The levers with a positive prediction together, per layer: summed, but of those that end at
    the same bound (Lever.limit) only the largest."""
    best: dict[str, float] = {}
    total = 0.0
    for lv in lvs:
        if lv.saving_s <= 0:
            continue
        if lv.limit:
            best[lv.limit] = max(best.get(lv.limit, 0.0), lv.saving_s)
        else:
            total += lv.saving_s
    return total + sum(best.values())


def _router_half_s(inp: Inputs, by: dict) -> float:
    """A router unit over half of K: its first panel staging and its release as now, the rest halved."""
    r = by["router"].measured_s
    fixed = inp.stage_s.get("router", 0.0) + inp.publish_s
    return fixed + max(0.0, r - fixed) / 2


def _router_halves_saving(inp: Inputs, by: dict) -> float:
    """Gate/up's start today minus with the router in K-halves: the later of the router path (oproj's
    end, the hop, the half unit, the hop to top-k, top-k) and the pooler's last block + the flag."""
    e = inp.edges
    router_path = e["oproj"][1] + by["oproj -> router"].measured_s + _router_half_s(inp, by) + \
        by["router -> topk"].measured_s + by["topk"].measured_s + by["topk -> expert1"].measured_s
    pool_path = e["pool"][1] + inp.end_tail_s.get("pool", 0.0) + inp.flag_s
    return e["expert1"][0] - max(router_path, pool_path)


def _spread_saving(inp: Inputs, plan, op: str, r: Row) -> float:
    """A dense op cut into 8-row units (program rounds over the grid): its time beyond staging and
    release scaled by the largest bytes a block streams then against now."""
    rows, k = {"qkv": (plan.cfg.qkv_rows, plan.cfg.d_model)}[op]
    cur = plan.tiles[op].rows

    def per_block(unit_rows: int) -> int:
        return -(-(rows // unit_rows) // inp.n_sm) * unit_rows * k * 2

    best = min(per_block(8), per_block(cur)) if rows % 8 == 0 else per_block(cur)
    return max(0.0, r.measured_s - r.hop_s) * (1 - best / per_block(cur))


def _combine_alone_s(inp: Inputs, plan, l2_sm: float) -> float:
    """One block merging a kv head's partials: PARTS partial O rows of head_dim fp32 per query row."""
    c = plan.cfg
    return c.group * inp.n_tokens * plan.attn_parts * c.head_dim * 4 / l2_sm


# ---------------------------------------------------------------------------------- markdown
def table(root: Path | None = None) -> str:
    """The critical-path table and the levers as markdown (what the report shows)."""
    inp = inputs(root)
    rs = rows(inp)
    return render(inp, rs, segment_rows(rs), levers(inp, rs))


def cold_code_lines(inp: Inputs, rs: Sequence[Row]) -> list[str]:
    """The cold-code column's reading: per segment, the ops' excess over their bound beside one
    pass over their code from L2 (a candidate term, not in the bound)."""
    if not inp.clock_hz:
        why = inp.sources.get("code_stale", "no megakernel.code result: `megabench mk code --save`")
        return [f"Cold code: not shown ({why})."]
    us, kb = 1e6, 1024
    parts = []
    for seg in ("front", "experts", "back"):
        ops = [r for r in rs if r.segment == seg and "->" not in r.item and not _off_path(r, rs)]
        parts.append(f"{seg} {sum(r.excess_s for r in ops) * us:.1f} us of excess against "
                     f"{sum(r.code_s for r in ops) * us:.1f} us of code ({sum(inp.code_bytes.get(r.item, 0) for r in ops) / kb:.0f} KB)")
    return [f"Cold code ({inp.sources.get('code', 'megakernel.code')}; {inp.sources.get('icache', 'icache.capacity')}): "
            f"a layer launch runs {inp.layer_code_bytes() / kb:.0f} KB of code (the schedule's "
            f"{inp.code_bytes.get('schedule', 0) / kb:.0f} KB included) against the SM's {inp.icache_bytes / kb:.0f} KB "
            "instruction cache, so each op's code is fetched from L2 once a layer. The column is one pass over the op's "
            "code at the L2-served rate, a candidate term the bound leaves out: along the path, " + "; ".join(parts)
            + ". A pass over an op's code is neither all of its time (loops run their bodies again, warm) nor all "
            "of its code (untaken branches are not fetched): the agreement is of sums, not a per-op fit. The column "
            "bounds what fetching can cost; it is no saving to bank on from making code warm."]


def ncu_lines(inp: Inputs, rs: Sequence[Row]) -> list[str]:
    """What the ops' own time stalls on (the per-op Nsight Compute account), beside each op's excess
    over its bound: the term the model has no bound for. Empty without an account."""
    if not inp.ncu_ops:
        return []
    us = 1e6
    on_path = [r for r in rs if "->" not in r.item and r.segment != "experts" and r.item in inp.ncu_ops]
    head = ["", f"What the front's and the back's ops stall on ({inp.sources['ncu']}: stall samples of every warp, "
            "so an op's samples are its warps' resident time, not its time on the path; copy waits are the op's "
            "bounded waits for its own bulk copies, the rest is its own work):", "",
            "| op | measured - bound us | cold code us | samples | at copy waits | own | own: instruction fetch | "
            "own: global and L2 loads | own work's top 3 |", "|---|---|---|---|---|---|---|---|---|"]
    body = []
    for r in on_path:
        n = inp.ncu_ops[r.item]
        code = f"{r.code_s * us:.2f}" if inp.clock_hz else ""
        body.append(f"| {r.item} | {r.excess_s * us:+.2f} | {code} | {n['samples']} | {n['copy_wait']} | {n['own']} | "
                    f"{n['own_no_inst']:.0f}% | {n['own_long_sb']:.0f}% | {n['own_top3']} |")
    fetch = [r.item for r in on_path if inp.ncu_ops[r.item]["own_no_inst"] >= 30]
    loads = [r.item for r in on_path if inp.ncu_ops[r.item]["own_long_sb"] >= 30]
    own = sum(inp.ncu_ops[r.item]["own"] for r in on_path)
    waits = sum(inp.ncu_ops[r.item]["copy_wait"] for r in on_path)
    fetch_share = sum(inp.ncu_ops[r.item]["own"] * inp.ncu_ops[r.item]["own_no_inst"] for r in on_path) / max(own, 1)
    load_share = sum(inp.ncu_ops[r.item]["own"] * inp.ncu_ops[r.item]["own_long_sb"] for r in on_path) / max(own, 1)
    tail = ["", f"Of these ops' {own + waits} samples, {waits} are at their copy waits and {own} in their own work; "
            f"of the own work {fetch_share:.0f}% waits on instruction fetch and {load_share:.0f}% on global or L2 loads. "
            + (f"Own work mostly fetching code (30% or more): {', '.join(fetch)}. " if fetch else "")
            + (f"Mostly waiting on loads: {', '.join(loads)}." if loads else "")]
    return head + body + tail


def render(inp: Inputs, rs: Sequence[Row], segs: Sequence[Row], lvs: Sequence[Lever]) -> str:
    us = 1e6

    def line(r: Row) -> str:
        code = "" if "->" in r.item or not inp.clock_hz else f"{r.code_s * us:.2f}"
        return (f"| {r.segment} | {r.item} | {r.measured_s * us:.2f} | {r.bytes / 1e6:.2f} | {r.bytes_s * us:.2f} | "
                f"{r.compute_s * us:.2f} | {r.hop_s * us:.2f} | {r.bound_s * us:.2f} | {r.excess_s * us:+.2f} | {code} | "
                f"{r.note} |")

    head = ("| segment | op or hop | measured us | MB | bytes at ceiling us | compute us | latency us | bound us | "
            "measured - bound us | cold code us | how |\n|---|---|---|---|---|---|---|---|---|---|---|")
    total = sum(r.measured_s for r in segs)
    lines = [f"Critical path of a {inp.preset} T={inp.n_tokens} ctx {inp.ctx} layer launch ({inp.sources['timeline']}; "
             f"{inp.distinct} experts a layer; read ceiling {inp.ceiling / 1e12:.2f} TB/s). Layer period "
             f"{inp.layer_s * us:.1f} us (step {inp.step_s * 1e3:.3f} ms / {inp.launches} launches), roofline "
             f"{inp.roofline_layer_s * us:.1f} us; 70% of the roofline is {inp.roofline_layer_s / 0.7 * us:.1f} us, 85% "
             f"{inp.roofline_layer_s / 0.85 * us:.1f} us. Rows along the critical path sum to {total * us:.1f} us.",
             "", head]
    lines += [line(r) for r in rs]
    lines += [line(r) for r in segs]
    lines += ["", *cold_code_lines(inp, rs)]
    lines += ncu_lines(inp, rs)
    lines += ["", f"Hop cost (what removing one saves): release {inp.publish_s * us:.2f} us (the kernel's publish; "
                  f"the fence microbenchmark under load {inp.fence_s * us:.2f} us) + flag {inp.flag_s * us:.2f} us + the "
                  "consumer's first staging + the producer's end tail.", "",
              "| lever | segment | predicted saving per layer us | step after ms | of roofline after | arithmetic |",
              "|---|---|---|---|---|---|"]
    for lv in lvs:
        after = lv.step_after_s(inp)
        lines.append(f"| {lv.name} | {lv.segment} | {lv.saving_s * us:+.2f} | {after * 1e3:.3f} | "
                     f"{inp.roofline_s / after:.1%} | {lv.how} |")
    exp = next(r for r in segs if r.segment == "experts")
    floor = max(exp.bytes_s, exp.compute_s) + exp.hop_s
    budget = inp.roofline_layer_s / 0.7 - floor
    lines += ["", f"The expert phase's floor is {floor * us:.1f} us a layer: its k-loop ({exp.compute_s * us:.1f} us of "
                  f"chunk compute a block) is {'above' if exp.compute_s > exp.bytes_s else 'below'} its bytes at the "
                  f"ceiling ({exp.bytes_s * us:.1f} us), plus its openings. 70% of the roofline then leaves "
                  f"{budget * us:.1f} us a layer for the front and the back together (measured "
                  f"{sum(r.measured_s for r in segs if r.segment != 'experts') * us:.1f} us, their bytes "
                  f"{sum(r.bytes_s for r in segs if r.segment != 'experts') * us:.1f} us, their latency bound "
                  f"{sum(r.bound_s for r in segs if r.segment != 'experts') * us:.1f} us)."]
    after = inp.step_s - combined_saving_s(lvs) * inp.launches
    lines += ["", f"All levers with a positive prediction together (those that end at the same bound counted once, "
                  f"the largest): {after * 1e3:.3f} ms, {inp.roofline_s / after:.1%} of "
                  f"the roofline (today {inp.roofline_s / inp.step_s:.1%}); 70% needs {inp.roofline_s / 0.7 * 1e3:.3f} ms, "
                  f"{(after - inp.roofline_s / 0.7) / inp.launches * us:.1f} us a layer more than they give. A lever that "
                  "removes a wait saves at most the slack behind it; one that narrows an op to fewer blocks pays its "
                  "extra rounds at about the op's whole time, because the front's and the back's ops are bound by "
                  "their units' latency, not their bytes. What built levers measured: reports/LEVERS.md."]
    return "\n".join(lines) + "\n"
