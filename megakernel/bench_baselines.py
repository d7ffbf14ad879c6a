"""model.baselines: the naive torch expression of the decode/verify step (eager, CUDA graph,
torch.compile; impl names naive_torch_*), timed by the shared harness. Not the competent
baseline: that is the peer (peer.py, megakernel.peer); these dequantise every padded expert slot
to bf16 each step (baselines.py).

For each (preset, T, ctx) point and each baseline (eager, CUDA graph, torch.compile
reduce-overhead; baselines.py), one Series named results_names.step_series_name(...):
  - correctness first: the baseline's logits and new K/V rows are compared with reference.step
    on the same fresh random KV cache, tokens and synthetic routing (CorrectnessError otherwise);
  - kernels per step counted by the profiler (kernel_count.py) on one step after warm-up;
  - device time per step (CUDA events) from an idle device, host submission included
    (Prepared.hold=False: an eager step of thousands of launches cannot be queued behind the
    harness's blocking kernel; for graph/compile the host part is the graph launches);
  - bound: Bound("time", roofline_s) with roofline_s = bytes the step must touch (roofline.py,
    the routed experts' union per layer) / the measured read ceiling (its source is named).
Routing: synthetic (routing.py), `study_like_distinct` experts per layer: 49 at shard8 T=16 (the
study's GSM8K count); other shapes keep the study's ratio to the uniform-random expectation.
Acceptance: measured per preset with the drafter stand-in (draft.py) and the eager baseline as
verifier on synthetic weights, reported as measured; tokens/s with the study's 6.6 is a
labelled projection.

Points. quick: small T=1,16 at ctx 512; shard8 T=1,16 at ctx 2048. full: two contexts per preset,
short and long (past the sliding window): small 512 and 4096 (W=1024), shard8 2048 and 8192
(W=2048). Weights are generated on the GPU once per process and per preset (shard8 ~60 GB) and
freed when the preset is done (`release`).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from microbench.harness import Case, Harness, Prepared, full_sweeps, run_case
from microbench.results import Bound, Derived, Env, Result, Series

from . import reference
from . import baselines as B
from . import tree as treelib
from .config import ModelConfig
from .config import preset as get_preset
from .draft import DraftModel
from .kernel_count import count_kernels
from .results_names import step_params, step_series_name
from .roofline import read_ceiling, roofline
from .routing import distinct_per_layer, synthetic_routes
from .speculative import measure_acceptance
from .weights import generate

BENCHMARK = "model.baselines"
STUDY_DISTINCT, STUDY_TOKENS, STUDY_EXPERTS, STUDY_TOP_K = 49, 16, 256, 8  # the study (reports/paper_figures.json): 49 of 256 at 16 x top-8
STUDY_ACCEPTANCE = 6.6  # the study: 16 verified, 6.6 accepted on average (GB300, GSM8K, DFlash V2)
QUICK_POINTS = {"small": [(1, 512), (16, 512)], "shard8": [(1, 2048), (16, 2048)]}
FULL_POINTS = {"small": [(t, c) for c in (512, 4096) for t in (1, 16)],
               "shard8": [(t, c) for c in (2048, 8192) for t in (1, 16)]}
ACCEPT_PROMPTS, ACCEPT_PROMPT_LEN, ACCEPT_NEW = 3, 8, 32
SEED = 2026
DEVICE = "cuda"  # the CPU dry run (tests/test_model_bench_dryrun.py) sets "cpu"


def _sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def _uniform_distinct(n_experts: int, slots: int) -> float:
    """Expected distinct experts when `slots` picks are uniform over n_experts."""
    return n_experts * (1 - (1 - 1 / n_experts) ** slots)


def study_like_distinct(cfg: ModelConfig, n_tokens: int) -> int:
    """Distinct experts per layer for synthetic routing: the study measured 49 at 16 tokens x top-8
    of 256, 0.487 of the 100.7 a uniform router would touch; keep that ratio, clamped to what the
    shape allows (k..min(E, T k)). 49 at shard8 T=16; 27 at small T=16; k at T=1."""
    ratio = STUDY_DISTINCT / _uniform_distinct(STUDY_EXPERTS, STUDY_TOKENS * STUDY_TOP_K)
    d = round(ratio * _uniform_distinct(cfg.n_experts, n_tokens * cfg.top_k))
    return int(min(max(d, cfg.top_k), cfg.max_distinct_experts(n_tokens)))


# ---------------------------------------------------------------------- per-process state
_WEIGHTS: dict = {}
_CONTEXTS: dict = {}
_ACCEPT: dict = {}
_NOTES: list[str] = []


def weights_for(preset: str):
    """The preset's weights on the GPU, generated once per process."""
    if preset not in _WEIGHTS:
        cfg = get_preset(preset)
        _sync()
        t0 = time.perf_counter()
        _WEIGHTS[preset] = generate(cfg, device=DEVICE)
        _sync()
        _NOTES.append(f"{preset}: weights generated on {DEVICE} in {time.perf_counter() - t0:.1f} s")
    return _WEIGHTS[preset]


# modules that hold GPU memory built on a preset's weights add a function here (it is called with
# the preset, None for all) so that release() frees that memory too
RELEASE_HOOKS: list[Callable[[str | None], None]] = []


def release(preset: str | None = None) -> None:
    """Free a preset's weights and everything built on them (all presets when None)."""
    for k in [k for k in _CONTEXTS if preset is None or k[0] == preset]:
        del _CONTEXTS[k]
    for k in [k for k in _WEIGHTS if preset is None or k == preset]:
        del _WEIGHTS[k]
    for k in [k for k in _ACCEPT if preset is None or k == preset]:
        del _ACCEPT[k]
    for hook in RELEASE_HOOKS:  # what other modules built on the weights (peer_bench's models)
        hook(preset)
    dynamo = sys.modules.get("torch._dynamo")  # only if something compiled (importing it costs ~2 s)
    if dynamo is not None:
        try:
            dynamo.reset()  # compiled graphs and cudagraph trees hold the weights' pools
        except Exception:
            pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class StepContext:
    preset: str
    cfg: ModelConfig
    n_tokens: int
    ctx: int
    tokens: object  # long [T] (cpu)
    parents: list[int]
    routes: list  # per layer long [T, k] (cpu)
    distinct: int
    cache0: object  # KVCache on the GPU, fresh random
    ref_logits: object
    ref_cache: object
    ref_s: float


def step_context(preset: str, n_tokens: int, ctx: int) -> StepContext:
    """Fresh random inputs and the reference's answer for one point (cached per process)."""
    key = (preset, n_tokens, ctx)
    if key not in _CONTEXTS:
        w = weights_for(preset)
        cfg = w.cfg
        g = torch.Generator().manual_seed(SEED + 1000 * n_tokens + ctx)
        gd = torch.Generator(device=DEVICE).manual_seed(SEED + ctx)
        distinct = study_like_distinct(cfg, n_tokens)
        routes = synthetic_routes(cfg, n_tokens, distinct, g)
        assert distinct_per_layer(routes) == [distinct] * cfg.n_layers
        parents = treelib.binary_ish(n_tokens) if n_tokens > 1 else [-1]
        tokens = torch.randint(0, cfg.vocab, (n_tokens,), generator=g)
        cache0 = reference.KVCache(cfg, device=DEVICE).fill_random(gd)
        ref_cache = cache0.clone()
        _sync()
        t0 = time.perf_counter()
        ref = reference.step(w, ref_cache, tokens, parents, ctx, routes=[r.to(DEVICE) for r in routes])
        _sync()
        _CONTEXTS[key] = StepContext(preset, cfg, n_tokens, ctx, tokens, parents, routes, distinct, cache0,
                                     ref, ref_cache, time.perf_counter() - t0)
    return _CONTEXTS[key]


def acceptance(preset: str):
    """speculative.AcceptanceReport of the drafter stand-in against the preset (eager verifier)."""
    if preset not in _ACCEPT:
        w = weights_for(preset)
        g = torch.Generator().manual_seed(SEED + 7)
        prompts = [torch.randint(0, w.cfg.vocab, (ACCEPT_PROMPT_LEN,), generator=g).tolist()
                   for _ in range(ACCEPT_PROMPTS)]
        t0 = time.perf_counter()
        dm = DraftModel(w)
        _ACCEPT[preset] = measure_acceptance(w, prompts, ACCEPT_NEW, dm, verifier=B.eager_step)
        del dm
        _NOTES.append(f"{preset}: acceptance measured in {time.perf_counter() - t0:.1f} s")
    return _ACCEPT[preset]


# ---------------------------------------------------------------------- cases
def baseline_case(preset: str, n_tokens: int, ctx: int, baseline: str, ceiling: tuple[float, str] | None = None,
                  tokens_per_step: float | None = None, accept_source: str = "") -> Case:
    """One Case: prepare() builds the baseline on a copy of the point's random cache, checks it
    against reference.step, counts its kernels, and returns the step launcher."""
    if baseline not in B.BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; have {B.BASELINES}")
    cfg = get_preset(preset)
    distinct = study_like_distinct(cfg, n_tokens)
    name = step_series_name(preset, n_tokens, ctx, baseline)
    params = step_params(preset, n_tokens, ctx, B.IMPL_NAMES[baseline], distinct, baseline=baseline)

    def prepare(h: Harness) -> Prepared:
        sc = step_context(preset, n_tokens, ctx)
        w = weights_for(preset)
        cache = sc.cache0.clone()
        runner = B.make_runner(baseline, w, cache, sc.parents, sc.tokens, ctx, routes=sc.routes)
        out = runner.run().clone()
        _sync()
        ag = B.compare(out, sc.ref_logits, cache, sc.ref_cache, ctx, n_tokens, what=name)
        kc = count_kernels(runner.run)
        launches, launches_src = kc.kernels_per_step, "CUPTI kernel activities of one step"
        if kc.kernels == 0 and baseline == "graph":  # the graph replays exactly the captured eager chain
            launches = count_kernels(runner.runner.run).kernels_per_step
            launches_src = "CUPTI reported no kernels inside the graph replay: count of the captured eager chain"
        if launches == 0:
            raise RuntimeError(f"{name}: the profiler saw no kernels in a step; cannot count launches")
        rl = roofline(cfg, n_tokens, ctx, distinct,
                      ceiling=ceiling or read_ceiling(gpu=h.info.name))
        metrics = {
            "launches_per_step": int(round(launches)), "launches_source": launches_src,
            "host_launch_calls_per_step": kc.launch_calls,
            "graph_launches_per_step": kc.graph_launches,
            "memcpy_per_step": kc.memcpy, "memset_per_step": kc.memset,
            "top_kernels": "; ".join(f"{n} x{c}" for n, c in kc.top[:5]),
            "bytes_per_step": rl.bytes.total, "roofline_s": rl.seconds, "read_ceiling_bytes_per_s": rl.read_ceiling,
            **{f"bytes_{k}": v for k, v in rl.bytes.as_dict().items() if k != "total"},
            "tokens_verified": n_tokens,
            "expert_slots": B.expert_slots(cfg, n_tokens),
            "dequant_bytes_per_step": B.dequant_bytes_per_step(cfg, n_tokens),
            "mm_out_dtype": int(B.torch_model(w).out_dtype),
            "reference_step_s": sc.ref_s,
            **ag.as_metrics(),
        }
        if tokens_per_step is not None:
            metrics["tokens_per_step"] = float(tokens_per_step)
            metrics["tokens_per_step_source"] = accept_source
        if baseline == "compile":
            st = B.compile_stats()
            metrics["compile_s"] = runner.compile_s
            metrics.update({f"compile_{k}": v for k, v in st.items()})
            if st["cudagraph_skips"] or st["graph_breaks"]:  # still timed: it is what torch.compile gave us
                print(f"WARNING {name}: torch.compile ran with {st['cudagraph_skips']} CUDA-graph skips and "
                      f"{st['graph_breaks']} graph breaks", file=sys.stderr)
        return Prepared(launch=runner.run, bound=Bound("time", rl.seconds, "s", f"roofline: {rl.bytes.total} B / "
                                                       f"{rl.read_ceiling:.4g} B/s ({rl.source})"),
                        metrics=metrics, hold=False)

    return Case(name, params, prepare)


def _policy(h: Harness):
    # chunks of 4 samples: a shard8 eager step takes ~0.2 s, and the budget is checked per chunk
    return replace(h.policy, chunk=4)


def _tokens_per_s(series: list[Series], acc: dict) -> dict[str, Derived]:
    """Derived throughput figures: T=1 plain decode; T=16 verify with the measured acceptance and,
    labelled as a projection, with the study's 6.6."""
    out = {}
    for s in series:
        p = s.params
        med = s.summary.median
        lo, hi = s.summary.q1, s.summary.q3  # step-time interquartile range -> spread of the rate
        if p["T"] == 1:
            out[f"{s.name}.tokens_per_s"] = Derived(1 / med, "tok/s", "1 token / median step time (plain greedy decode)",
                                                    (1 / hi, 1 / lo), (s.name,))
            continue
        a = acc.get(p["preset"])
        if a is not None:
            out[f"{s.name}.tokens_per_s_measured_acceptance"] = Derived(
                a.mean / med, "tok/s", "measured mean acceptance (tokens per verify step) / median step time",
                (a.ci[0] / hi, a.ci[1] / lo), (s.name,),
                f"acceptance {a.mean:.2f} measured with the drafter stand-in on synthetic weights "
                f"(backbone follow rate {a.follow_rate:.0%}); not the study's workload")
        out[f"{s.name}.tokens_per_s_projected_study_acceptance"] = Derived(
            STUDY_ACCEPTANCE / med, "tok/s", f"PROJECTION: the study's acceptance {STUDY_ACCEPTANCE} (GB300, GSM8K) "
            f"/ median step time", (STUDY_ACCEPTANCE / hi, STUDY_ACCEPTANCE / lo), (s.name,),
            "projection with an assumed acceptance, not a measurement")
    return out


class Collector:
    """model.baselines built point by point: acceptance per preset, one case per (point, baseline),
    then the Result. `run` drives it over the points; the megakernel stage of `megabench run`
    interleaves it with the megakernel's own points of the same preset (one weights generation,
    one reference step per point for both). A failed case is a note; with `strict` it also raises
    (after the note), so the caller reports it."""

    def __init__(self, h: Harness | None = None, quick: bool | None = None, strict: bool = False):
        self.h = h or Harness()
        self.quick = (not full_sweeps()) if quick is None else quick
        self.strict = strict
        self.ceiling = read_ceiling(gpu=self.h.info.name)
        self.series: list[Series] = []
        self.notes: list[str] = [f"read ceiling {self.ceiling[0]:.4g} B/s: {self.ceiling[1]}",
                                 "timing: each sample starts on an idle device and includes host submission "
                                 "(stream not held)"]
        self.derived: dict[str, Derived] = {}
        self.accs: dict = {}
        self.busy_s = 0.0  # in acceptance() and case(): the megakernel stage interleaves other work

    def _failed(self, msg: str, e: Exception) -> None:
        self.notes.append(msg)
        print(msg, file=sys.stderr)
        if self.strict:
            raise e

    def acceptance(self, preset: str) -> None:
        t0 = time.perf_counter()
        try:
            a = acceptance(preset)
        except Exception as e:  # reported, never silently dropped
            self._failed(f"{preset}: acceptance FAILED: {e.__class__.__name__}: {e}", e)
            return
        finally:
            self.busy_s += time.perf_counter() - t0
        self.accs[preset] = a
        self.derived[f"{preset}.acceptance_length"] = Derived(
            a.mean, "tokens/step", f"mean tokens emitted per verify step (accepted drafts + bonus) over "
            f"{len(a.lengths)} steps, {a.n_prompts} prompts x {ACCEPT_NEW} tokens, {a.n_tree}-token tree "
            f"(branch depth {a.branch_depth}); spread: bootstrap 90% interval", a.ci, (),
            f"drafter stand-in (draft.py) on synthetic weights; backbone follow rate {a.follow_rate:.0%}")
        self.derived[f"{preset}.backbone_follow_rate"] = Derived(
            a.follow_rate, "", "fraction of emitted tokens equal to succ(previous): how predictable the "
            "synthetic target is", None, (), "")

    def case(self, preset: str, t: int, c: int, b: str) -> Series | None:
        a = self.accs.get(preset)
        tps, src = (1.0, "T=1 plain decode yields one token") if t == 1 else (
            (a.mean, "measured acceptance, drafter stand-in, synthetic weights") if a else (None, ""))
        case = baseline_case(preset, t, c, b, self.ceiling, tps, src)
        t0 = time.perf_counter()
        try:
            s = run_case(self.h, case, policy=_policy(self.h))
            self.series.append(s)
            return s
        except Exception as e:
            self._failed(f"{case.name}: FAILED: {e.__class__.__name__}: {e}", e)
            return None
        finally:
            gc.collect()
            if DEVICE.startswith("cuda"):
                torch.cuda.empty_cache()
            self.busy_s += time.perf_counter() - t0

    def result(self, save: bool = True) -> Result:
        notes = self.notes + _NOTES + [f"wall time {self.busy_s:.0f} s (acceptance and cases; weights generated "
                                       "once per preset, shared with the megakernel's points in `megabench run`)"]
        derived = {**self.derived, **_tokens_per_s(self.series, self.accs)}
        res = Result(BENCHMARK, Env.capture(self.h.device_index), tuple(self.series), derived, quick=self.quick,
                     notes=tuple(notes))
        if save:
            res.save()
        return res


def run(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    del _NOTES[:]
    col = Collector(h, quick)
    for preset, pts in (QUICK_POINTS if col.quick else FULL_POINTS).items():
        col.acceptance(preset)
        for t, c in pts:
            for b in B.BASELINES:
                col.case(preset, t, c, b)
        release(preset)
    return col.result(save)


BENCHMARKS = {BENCHMARK: run}


def main(argv=None, prog: str = "python -m megakernel.bench_baselines") -> int:
    """`python -m megakernel.bench_baselines [--full] [--no-save]`: run model.baselines and print it."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="full points (two contexts per preset)")
    ap.add_argument("--no-save", action="store_true", help="do not write the result file")
    args = ap.parse_args(argv)
    res = run(quick=not args.full, save=not args.no_save)
    for s in res.series:
        m = s.metrics
        frac = f"{s.fraction_of_bound:6.1%}" if s.fraction_of_bound else "   n/a"
        print(f"{s.name:32s} {s.summary.median * 1e3:9.3f} ms  roofline {m.get('roofline_s', 0) * 1e3:7.3f} ms ({frac})"
              f"  {m.get('launches_per_step')} kernels/step" + (f"  compile {m['compile_s']:.1f} s" if "compile_s" in m else ""))
    for k, d in res.derived.items():
        print(f"  -> {k} = {d.value:.4g} {d.unit}")
    for n in res.notes:
        print(f"  note: {n}")
    return 1 if any("FAILED" in n for n in res.notes) else 0


if __name__ == "__main__":
    sys.exit(main())
