"""What the report reads from the model and megakernel results, and the conventions they follow.

Result names (benchmark field of a megabench Result; files under reports/results/<prefix>/):
  model.baselines     the torch baselines (eager, CUDA graph, torch.compile)
  megakernel.step     our chain mode and mega mode (and their variants)
  megakernel.timeline the in-kernel profiler's per-block phase stamps for one step
  megakernel.build    per-launch code bytes / registers / spills / smem of the built megakernel
  megakernel.<other>  anything else (e.g. megakernel.ablation): shown as a generic table

Step series (in model.* and megakernel.* results): any series with `params["impl"]` and unit "s".
  samples   device seconds per decode step (timer "cuda_event" or "globaltimer")
  params    impl     "mega" | "chain" | "chain_pdl" | "peer" | "torch_eager" | "torch_graph" |
                     "torch_compile" | "mega+<variant>" | any other name (a new baseline kind shows
                     up in the report's summary by itself; IMPL_LABELS names the known ones).
                     An impl starting with "mega" is a megakernel, everything else a baseline;
                     "mega+<variant>" rows are ablation variants (the report's appendix), and
                     the torch_* ones are the naive torch expression of the model, labelled so
                     (model.baselines names them naive_torch_*; older results' torch_* names are
                     read as those, LEGACY_IMPL). "chain" runs with PDL where the plan has it,
                     "chain_nopdl" without (runtime.launch_pdl_flags).
            routing  "forced" (default: the synthetic routing replayed) | "real" (the build's own
                     top-k): part of a row's configuration, so rows compare like with like
            preset   model preset name ("tiny", "small", "shard8")
            tokens   T, tokens verified per step (1 = plain decode, 16 = the study's verify)
            context  cached tokens before the step
            batch    sequences (default 1)
  metrics   launches_per_step  kernel launches per step, counted by a profiler (int)
            bytes_per_step     bytes the step must touch (weights routed + KV read + writes)
            roofline_s         bytes_per_step / measured read ceiling (or give it as the bound:
                               Bound("time", roofline_s, "s", ...), then fraction_of_bound is the
                               fraction of roofline)
            accepted_tokens_per_step  measured mean tokens a speculative step yields (acceptance).
                               Tokens/s is always accepted tokens with the acceptance stated
                               (StepRow.acceptance): measured when a series carries it, 1 per
                               sequence for T = 1 (plain decode), else the study's 6.6 per 16-token
                               verify step, assumed and labelled (no draft model runs here)
  The series name is free (e.g. "step/mega/shard8/T16/ctx4096"); the report reads params.

Timeline series (megakernel.timeline; failing that, the first result whose series carry phase and
edge params, e.g. the clocks profiler's demo): one series per (phase, edge):
  params    phase (str, e.g. "attention", "gemm1", "gemm2", "combine"), edge "start" | "end",
            optional layer (int)
  samples   per-block offsets in seconds from the launch's earliest stamp (timer "globaltimer")

Build record (megakernel.build): derived "launch_code_bytes_max" (B), the largest launch's code.

Speculative runs (megakernel.decode, megakernel/decode.py to_result): one series per run, its
samples the steps' wall times (s), params preset, batch, tree_tokens, mode ("mega" | "chain"),
agree, acceptance (the named configuration or "custom"), backend ("gpu" | "emu"); metrics
accepted_tokens_per_s, accepted_tokens_per_step (the measured mean), histogram, depth_rates,
draft_s / verify_s / accept_s / gaps_s (medians per step), draft_launches / verify_launches /
accept_launches, check. Only GPU runs are read (decode_rows): an emulated run's times are a CPU's.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from microbench.adopt import result_revision
from microbench.fmt import fmt
from microbench.results import Result, Series

from megakernel.results_names import PER_GROUP_CHAIN, PER_GROUP_IMPL, UNION_IMPL

PRESET_ORDER = ("shard8", "small", "tiny")
# model.baselines' impl names before they said naive: read as the new ones, so the fastest-run rule
# (with_fastest_baselines) still sees the older runs of the same implementation
LEGACY_IMPL = {"torch_eager": "naive_torch_eager", "torch_graph": "naive_torch_graph",
               "torch_compile": "naive_torch_compile"}
STUDY_ACCEPTANCE = 6.6  # the study's mean accepted tokens per 16-token verify step (GSM8K, its draft model)
STUDY_VERIFY_TOKENS = 16

# How the report names each implementation. Unknown impls are shown by their own name; any
# "torch_*" impl is the model written plainly in torch (it dequantises every padded expert slot to
# bf16 each step, megakernel/baselines.py), which no serving engine runs: it is labelled as that.
IMPL_LABELS = {
    "mega": "megakernel (ours)",
    "chain": "kernel chain (ours: same ops, a launch each, CUDA graph, PDL)",
    PER_GROUP_IMPL: "megakernel, each row group streaming its own routed experts (ablation; the default runs "
                    "their union)",
    PER_GROUP_CHAIN: "kernel chain, each row group streaming its own routed experts (the ablation's build)",
    "chain_pdl": "kernel chain with PDL (ours)",
    "chain_nopdl": "kernel chain without PDL (ours)",
    "peer": "peer: Triton fused MoE (vLLM's generic kernel style) + cuBLAS, one CUDA graph",
    "peer_compile": "peer's torch parts under torch.compile",
    "torch_compile": "naive torch expression, torch.compile",
    "torch_graph": "naive torch expression, CUDA graph",
    "torch_eager": "naive torch expression, eager",
}
IMPL_LABELS.update({f"naive_{k}": v for k, v in list(IMPL_LABELS.items()) if k.startswith("torch_")})


def is_naive(impl: str) -> bool:
    """The plain-torch expression of the model (not a competent baseline): `torch_*`, or
    `naive_*` as the baselines may name it."""
    return impl.startswith(("torch_", "naive_"))


def is_ablation(impl: str) -> bool:
    """A megakernel build with techniques switched (the ablation), not the default build."""
    return impl.startswith("mega+")


def impl_label(impl: str) -> str:
    if impl in IMPL_LABELS:
        return IMPL_LABELS[impl]
    return f"naive torch expression ({impl.split('torch_', 1)[-1]})" if is_naive(impl) else impl


def impl_rank(impl: str) -> tuple:
    """Summary order: the megakernel, then competent baselines (ours, then others), then naive torch."""
    known = ("mega", "peer", "peer_compile", "chain_pdl", "chain", "chain_nopdl")
    if impl in known:
        return (0, known.index(impl), impl)
    return (2, 0, impl) if is_naive(impl) else (1, 0, impl)


def config_rank(cfg: tuple) -> tuple:
    """(preset, tokens, context, batch[, anything after, e.g. the routing]) in report order."""
    preset, tokens, context, batch, *rest = cfg
    pi = PRESET_ORDER.index(preset) if preset in PRESET_ORDER else len(PRESET_ORDER)
    return (pi, preset, -tokens, -context, batch, *map(str, rest))


def config_label(cfg: tuple) -> str:
    preset, tokens, context, batch, *rest = cfg
    extra = [str(x) for x in rest if x not in (None, "forced")]  # e.g. "real" routing
    return (f"{preset} T={tokens} ctx={context}" + (f" batch={batch}" if batch != 1 else "")
            + "".join(f" {x}" for x in extra))


@dataclass(frozen=True)
class StepRow:
    benchmark: str
    series: Series
    impl: str
    preset: str
    tokens: int
    context: int
    batch: int
    commit: str = ""  # the measuring run's commit (short)
    date: str = ""  # and its date (ISO 8601 UTC)
    constants: tuple = (None, "")  # (constants revision the build read, how that is known)
    routing: str = "forced"  # params["routing"]: the synthetic routing replayed, or the build's own

    @property
    def config(self) -> tuple:
        return (self.preset, self.tokens, self.context, self.batch, self.routing)

    @property
    def is_mega(self) -> bool:
        return self.impl.startswith("mega")

    @property
    def step_s(self) -> float:
        return self.series.summary.median

    @property
    def tokens_per_step(self) -> tuple[float, bool]:
        """(tokens per step, measured-yield?)"""
        t = self.series.metrics.get("accepted_tokens_per_step")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            return float(t), True
        return float(self.tokens * self.batch), False

    @property
    def acceptance(self) -> tuple[float, str]:
        """(accepted tokens per step, where that number comes from)."""
        t, measured = self.tokens_per_step
        if measured:
            return t, "measured"
        if self.tokens == 1:
            return float(self.batch), "plain decode: every token is accepted"
        if self.tokens == STUDY_VERIFY_TOKENS:
            return (STUDY_ACCEPTANCE * self.batch,
                    f"PROJECTION at the study's {STUDY_ACCEPTANCE:g} of {STUDY_VERIFY_TOKENS}, assumed: a verify step's "
                    "rate, no draft half; measured accepted tokens/s are megakernel.decode's")
        return t, "not stated: tokens processed (T x batch)"

    @property
    def accepted_tokens_per_s(self) -> float:
        return self.acceptance[0] / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step[0] / self.step_s

    @property
    def launches(self) -> int | None:
        v = self.series.metrics.get("launches_per_step")
        return int(v) if isinstance(v, (int, float)) else None

    @property
    def roofline_s(self) -> float | None:
        b = self.series.bound
        if b is not None and b.kind == "time" and b.unit == "s":
            return b.value
        v = self.series.metrics.get("roofline_s")
        return float(v) if isinstance(v, (int, float)) else None

    @property
    def roofline_fraction(self) -> float | None:
        r = self.roofline_s
        return r / self.step_s if r else None


def step_rows(results: Sequence[Result]) -> list[StepRow]:
    rows = []
    for r in results:
        if not (r.benchmark.startswith("model.") or r.benchmark.startswith("megakernel.")):
            continue
        for s in r.series:
            p = s.params
            if "impl" not in p or s.unit != "s" or s.timer == "static":
                continue
            impl = LEGACY_IMPL.get(str(p["impl"]), str(p["impl"]))
            impl = _row_group_impl(impl, s.metrics)
            rows.append(StepRow(r.benchmark, s, impl, str(p.get("preset", "?")), int(p.get("tokens", 1)),
                                int(p.get("context", 0)), int(p.get("batch", 1)), r.env.git_sha[:7], r.env.date,
                                _revision(r), str(p.get("routing", "forced"))))
    return rows


def _row_group_impl(impl: str, metrics: dict) -> str:
    """Row-group steps under what they ran: the union build (results named it UNION_IMPL while it
    was a variant) is the megakernel's default past 16 rows, "mega"; a mega or chain step in row
    groups without it (union_experts 0, or a result older than the union) is the per-group
    ablation's build, so that no row compares the two builds under one name."""
    if impl == UNION_IMPL:
        return "mega"
    if impl in ("mega", "chain") and int(metrics.get("row_groups", 1)) > 1 and not int(metrics.get("union_experts", 0)):
        return PER_GROUP_IMPL if impl == "mega" else PER_GROUP_CHAIN
    return impl


def _revision(r: Result) -> tuple:
    if not r.benchmark.startswith("megakernel."):
        return None, "a torch baseline: reads no tuned constants"

    return result_revision(r)


def with_fastest_baselines(rows: Sequence[StepRow], baseline_runs: Sequence[Result]) -> list[StepRow]:
    """`rows` (the latest runs) with each torch baseline row (a model.* result) replaced by the
    fastest run of that implementation at that configuration among `baseline_runs`: the
    megakernel's speed-ups are then against the best each baseline has measured, and a later,
    slower baseline run (e.g. torch.compile after the expert codes moved to the kernel's word
    layout, README) does not inflate them. Runs within TIE of the fastest count as equally fast
    and the newest of them is taken (its roofline from the newest read ceiling). A baseline's
    fastest run is shown at every configuration the newest rows time, also where its newest run did
    not reach it; configurations only older runs have are not added."""
    best = fastest_baselines(baseline_runs)
    # one row per (implementation, configuration): two results of one session both time the
    # megakernel and its chain (megakernel.step and megakernel.peer): the newer one's row is shown
    newest: dict[tuple, StepRow] = {}
    for r in rows:
        k = (r.impl, r.config)
        if r.benchmark.startswith("model."):
            r = best.get(k, r)
        if k not in newest or r.date > newest[k].date:
            newest[k] = r
    # a configuration the megakernel was timed at gets each baseline's fastest committed run there,
    # also where the newest baseline run did not reach it (a run that ran out of memory at shard8)
    cfgs = {r.config for r in newest.values()}
    for k, b in best.items():
        if k[1] in cfgs and k not in newest:
            newest[k] = b
    return list(newest.values())


def fastest_baselines(baseline_runs: Sequence[Result]) -> dict[tuple, StepRow]:
    """{(impl, config): the row with_fastest_baselines shows} over the model.* runs given (the
    retention rule keeps the files these rows come from)."""
    cands: dict[tuple, list[StepRow]] = {}
    for row in step_rows([r for r in baseline_runs if r.benchmark.startswith("model.")]):
        cands.setdefault((row.impl, row.config), []).append(row)
    best = {}
    for k, rs in cands.items():
        fastest = min(x.step_s for x in rs)
        best[k] = max((x for x in rs if x.step_s <= fastest * (1 + TIE)), key=lambda x: x.date)
    return best


TIE = 0.01  # with_fastest_baselines: runs this close to the fastest count as equally fast


def _pref(row: StepRow) -> tuple:
    pi = PRESET_ORDER.index(row.preset) if row.preset in PRESET_ORDER else len(PRESET_ORDER)
    # the study runs batch 1: a batched row is never the one its figures are compared with
    return (pi, row.routing != "forced", row.batch != 1, -row.tokens, -row.context, row.batch)


def pick(rows: Sequence[StepRow], impl: str, tokens: int | None = None) -> StepRow | None:
    """The row the study's figure is compared with: impl 'mega' (fastest megakernel variant),
    'chain', or 'best_baseline' (fastest non-megakernel); T filtered when given; preferring the
    shard8 preset, forced routing (what the study's figures compare), then larger T, longer context."""
    rs = [r for r in rows if tokens is None or r.tokens == tokens]
    if not rs:
        return None
    cfg = min(rs, key=_pref).config
    rs = [r for r in rs if r.config == cfg]
    if impl == "mega":
        rs = [r for r in rs if r.is_mega]
    elif impl == "best_baseline":
        rs = [r for r in rs if not r.is_mega]
    else:
        rs = [r for r in rs if r.impl == impl]
    return min(rs, key=lambda r: r.step_s) if rs else None


def figure_value(rows: Sequence[StepRow], timeline: Result | None, ours: dict) -> tuple[float, str, str] | None:
    """(value, unit, how) for a paper figure whose ours.kind is 'megakernel'; None if not measured."""
    m = ours.get("metric")
    tokens = ours.get("tokens")
    if m in ("tokens_per_s", "step_s", "launches_per_step", "tokens_per_step"):
        r = pick(rows, ours.get("impl", "mega"), tokens)
        if r is None:
            return None
        how = f"{r.impl}, {r.preset}, T={r.tokens}, ctx={r.context}"
        if m == "tokens_per_s":
            acc, src = r.acceptance
            return r.accepted_tokens_per_s, "tok/s", how + f": {acc:g} accepted tokens per step ({src})"
        if m == "step_s":
            return r.step_s, "s", how
        if m == "launches_per_step":
            return (float(r.launches), "launches", how) if r.launches is not None else None
        t, measured = r.tokens_per_step
        return (t, "tokens", how) if measured else None
    if m == "speedup_vs_chain":
        mega, chain = pick(rows, "mega", tokens), pick(rows, "chain", tokens)
        if mega is None or chain is None or mega.config != chain.config:
            return None
        return chain.step_s / mega.step_s, "x", f"chain / mega, {mega.preset}, T={mega.tokens}"
    if m and m.startswith("timeline_") and timeline is not None:
        _, edge, q = m.split("_")
        for s in timeline.series:
            if s.params.get("phase") == ours.get("phase") and s.params.get("edge") == edge:
                return float(np.percentile(s.samples, int(q[1:]))), "s", f"{edge} of {ours.get('phase')}, {q}"
    return None


def batch_curve(rows: Sequence[StepRow]) -> list[dict]:
    """The study's claim that a megakernel finds larger batches easier, as measured: for each
    (preset, context) and step shape (T = 1 at B = 1, 2, 4, 8; B x T = 16 rows at B = 1, 2, 4), the
    megakernel's, its chain's and the peer's (megakernel.peer at B requests a step) step time (and T = 16
    at B = 2, 4, 8: 32..128 rows, which the megakernel and its chain run in row groups of 16, the
    "row groups" column, their routed experts over the union of the groups' routing; results older
    than row groups hold the peer's alone there; PER_GROUP_IMPL / PER_GROUP_CHAIN: the ablation
    whose every group streams its own experts, against mega's / the chain's B = 1 row),
    tokens processed per second (B x T a step), the fraction of the batch's roofline, the routed
    experts' weight streams a layer that the build makes (a model from the routing: row groups
    stream each group's experts, the union an expert once per 16 of its tokens; blank in results
    older than it), each against
    the same implementation at B = 1, and mega's speed-up over the chain and the peer at the same B
    (where results hold both). An implementation appears at the B its results hold (a shape's row of
    an implementation with no batched row is left out). Forced routing only."""
    rs = [r for r in rows
          if r.routing == "forced" and r.impl in ("mega", "chain", "peer", PER_GROUP_IMPL, PER_GROUP_CHAIN)]

    def shapes(r: StepRow) -> list[str]:
        # T = 16 at B = 1 is the base of two curves: T = 16 trees at B = 2, 4, 8, and 16 rows split
        # into B smaller trees
        out = ["T=1"] if r.tokens == 1 else ["T=16"] if r.tokens == 16 else []
        if r.tokens != 1 and r.tokens * r.batch == 16:
            out.append("B x T = 16")
        return out

    groups: dict[tuple, dict[int, StepRow]] = {}
    for r in rs:
        for sh in shapes(r):
            g = groups.setdefault((r.preset, r.context, sh, r.impl), {})
            if r.batch not in g or r.date > g[r.batch].date:
                g[r.batch] = r
    out = []
    order = sorted(groups, key=lambda k: (PRESET_ORDER.index(k[0]) if k[0] in PRESET_ORDER else 9, k[1], k[2], k[3]))
    for key in order:
        g = groups[key]
        if max(g) == 1:
            continue
        mega = groups.get((*key[:3], "mega"), {})
        # the ablation's builds have no B = 1 row: mega's and the chain's
        plain = {PER_GROUP_IMPL: "mega", PER_GROUP_CHAIN: "chain"}.get(key[3])
        base = g.get(1) or (groups.get((*key[:3], plain), {}).get(1) if plain else None)
        for b in sorted(g):
            r = g[b]
            frac = r.roofline_fraction
            m = mega.get(b)
            out.append({"preset": r.preset, "ctx": r.context, "shape": key[2], "B": b, "T": r.tokens, "impl": r.impl,
                        "step time": fmt(r.step_s, "s"), "tokens/s": fmt(r.tokens_per_s, "tok/s"),
                        "of roofline": f"{frac:.1%}" if frac else "",
                        "step vs B=1": f"x{r.step_s / base.step_s:.2f}" if base else "no B=1 row",
                        "tokens/s vs B=1": f"x{r.tokens_per_s / base.tokens_per_s:.2f}" if base else "no B=1 row",
                        "mega speed-up": f"x{r.step_s / m.step_s:.2f}" if m is not None and r.impl != "mega" else "",
                        # groups.GroupEngine: the weights read once per group (a result before row groups: one)
                        "row groups": "" if r.impl == "peer" else str(int(r.series.metrics.get("row_groups", 1))),
                        # the build's routed-expert weight streams a layer (routing.expert_streams_per_layer)
                        "expert streams": _streams(r.series.metrics.get("expert_streams_per_layer")),
                        "run": f"{r.commit} {r.date[:10]}"})
    return out


def _streams(v) -> str:
    return f"{float(v):.1f}" if v is not None else ""


def timeline_phases(result: Result) -> list[dict]:
    """[{phase, start (median), end (median), end_p10, end_p90, blocks}] ordered by start."""
    acc: dict[str, dict] = {}
    for s in result.series:
        ph, edge = s.params.get("phase"), s.params.get("edge")
        if ph is None or edge not in ("start", "end"):
            continue
        a = acc.setdefault(str(ph), {"phase": str(ph)})
        x = np.asarray(s.samples)
        a[edge] = float(np.median(x))
        a[f"{edge}_p10"], a[f"{edge}_p90"] = (float(v) for v in np.percentile(x, [10, 90]))
        a["blocks"] = int(x.size)
    out = [a for a in acc.values() if "start" in a and "end" in a]
    return sorted(out, key=lambda a: a["start"])


def op_pivot(derived: dict, ops: Sequence[str]) -> tuple[list[str], dict[str, dict[str, str]], list[str]]:
    """Per-op derived values (`<what>_<op>_s`, e.g. idle_wait_expert1_s) as a table with one row per
    op and one column per `<what>`: (columns, {op: {column: key}}, keys left over). A `<what>` with
    a single op stays a plain row. The longest op name that fits wins (attn_combine before attn)."""
    by_op = sorted(ops, key=len, reverse=True)
    hits: dict[str, dict[str, str]] = {}
    for k in derived:
        for op in by_op:
            m = re.fullmatch(rf"(.+)_{re.escape(op)}_s", k)
            if m:
                hits.setdefault(m.group(1), {})[op] = k
                break
    cols = [c for c in hits if len(hits[c]) >= 2]
    table: dict[str, dict[str, str]] = {}
    for c in cols:
        for op, k in hits[c].items():
            table.setdefault(op, {})[c] = k
    used = {k for c in cols for k in hits[c].values()}
    order = {op: i for i, op in enumerate(ops)}
    table = dict(sorted(table.items(), key=lambda kv: order.get(kv[0], len(order))))
    return cols, table, [k for k in derived if k not in used]


# ----------------------------------------------------------------------------- speculative runs
@dataclass(frozen=True)
class DecodeRow:
    """One `megabench decode` run on a GPU (megakernel.decode)."""
    series: Series
    preset: str
    batch: int
    mode: str
    agree: float
    acceptance: str
    commit: str
    date: str
    ranks: int = 1  # the verifier's tensor-parallel ranks
    where: str = "gpu"  # "gpu": one GPU (R ranks sharing its SMs), "torchrun": one process per GPU
    tree: int = 16  # each request's verify tree tokens (16 / B, or 16 with full trees: a row group each)

    def metric(self, key: str) -> float | None:
        v = self.series.metrics.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    @property
    def tok_s(self) -> float:
        return self.metric("accepted_tokens_per_s") or 0.0

    @property
    def mean(self) -> float:
        return self.metric("accepted_tokens_per_step") or 0.0

    @property
    def step_s(self) -> float:
        return self.series.summary.median


def decode_rows(results: Sequence[Result]) -> list[DecodeRow]:
    """The GPU runs of `megabench decode` among `results`, newest last (an emulated run's times are
    a CPU's: never a row)."""
    rows = []
    for r in results:
        if r.benchmark != "megakernel.decode" or not r.env.gpu:
            continue
        for s in r.series:
            p = s.params
            if p.get("backend", "gpu") != "gpu":
                continue
            rows.append(DecodeRow(s, str(p.get("preset", "?")), int(p.get("batch", 1)), str(p.get("mode", "mega")),
                                  float(p.get("agree", float("nan"))), str(p.get("acceptance", "?")),
                                  r.env.git_sha[:7], r.env.date, int(p.get("ranks", 1)),
                                  str(p.get("where", "gpu")), int(p.get("tree_tokens", 16))))
    return sorted(rows, key=lambda d: d.date)


def pick_decode(rows: Sequence[DecodeRow], mode: str = "mega") -> DecodeRow | None:
    """The run the study's figures are compared with: `mode`, batch 1, one rank, the named 'study' acceptance
    where there is one, shard8 first, the newest."""
    rs = [d for d in rows if d.mode == mode and d.batch == 1 and d.ranks == 1]
    if not rs:
        return None
    return max(rs, key=lambda d: (d.acceptance == "study", -PRESET_ORDER.index(d.preset) if d.preset in PRESET_ORDER
                                  else -9, d.date))


def decode_table(rows: Sequence[DecodeRow]) -> list[dict]:
    """One row per GPU run: its acceptance and rate, and the step's split."""
    out = []
    for d in rows:
        ms = lambda k: fmt(d.metric(k), "s") if d.metric(k) is not None else ""  # noqa: E731
        ranks = str(d.ranks) if d.ranks == 1 else f"{d.ranks} ({'one per GPU' if d.where == 'torchrun' else 'one GPU'})"
        out.append({"preset": d.preset, "B": d.batch, "tree": d.tree, "ranks": ranks, "mode": d.mode,
                    "acceptance": f"{d.acceptance} (agree {d.agree:g})",
                    "mean accepted": f"{d.mean:.2f}", "accepted tokens/s": fmt(d.tok_s, "tok/s"),
                    "step": fmt(d.step_s, "s"), "draft": ms("draft_s"), "verify": ms("verify_s"),
                    "accept + compaction": ms("accept_s"), "gaps": ms("gaps_s"),
                    "check": str(d.series.metrics.get("check", "")), "run": f"{d.commit} {d.date[:10]}"})
    return out


def acceptance_curve(rows: Sequence[StepRow], decode: Sequence[DecodeRow]) -> dict | None:
    """Accepted tokens/s against acceptance: the projection of the megakernel's T=16 step (a
    tokens per step over its step time, no draft half) and the measured runs of its preset, or None
    without a T=16 megakernel row. {preset, step_s, projection: [(a, tok/s)], study: (6.6, tok/s),
    measured: [(mean, tok/s, label)]}."""
    mega = pick(rows, "mega", STUDY_VERIFY_TOKENS)
    if mega is None:
        return None
    accs = list(np.linspace(1.0, 13.0, 25))
    measured = [(d.mean, d.tok_s, f"{d.mode} B={d.batch} T={d.tree}{f' R={d.ranks}' if d.ranks > 1 else ''} {d.acceptance} "
                                  f"({d.date[:10]})") for d in decode if d.preset == mega.preset]
    return {"preset": mega.preset, "context": mega.context, "step_s": mega.step_s,
            "projection": [(a, a / mega.step_s) for a in accs],
            "study": (STUDY_ACCEPTANCE, STUDY_ACCEPTANCE / mega.step_s), "measured": measured}
