"""`megabench run`'s budget: which items the default and --full run, the progress lines with their
estimates, where the estimates come from, and the run's own wall time as a typed result (run.wall).
Stand-in items and a fake clock; no GPU."""
from __future__ import annotations

import argparse

import pytest
from megabench_synth import H200, env

from reports import run as pipeline
from microbench.gate import compare, load_measurements
from microbench.progress import BENCHMARK, Estimates, Item, Progress
from microbench.results import load


def _args(full=False, classes=None):
    return argparse.Namespace(full=full, classes=classes, constants_out=None, write_constants=False, out=None,
                              no_report=False)


@pytest.fixture
def gpu_wiring(monkeypatch):
    """pipeline.items() as on the H200 (one GPU, 16 CPUs), with the registry's real benchmark names."""
    monkeypatch.setattr("microbench.xgpu.launcher.gpus_or_reason", lambda: (1, "1 GPU on this node"))
    monkeypatch.setattr("os.cpu_count", lambda: 16)


def _names(items, stage):
    return [i.name for i in items if i.stage == stage]


def test_default_keeps_checks_headline_timings_and_the_peer_and_leaves_the_rest_to_full(gpu_wiring, tmp_path):
    its = pipeline.items(_args(), tmp_path, gpu=True)
    assert list(dict.fromkeys(i.stage for i in its)) == ["microbenchmarks", "cross-GPU microbenchmarks",
                                                         "gate quality", "tune", "megakernel", "report"]
    micro = _names(its, "microbenchmarks")
    assert "sync.flags" in micro and "icache.capacity" in micro and "model.baselines" not in micro
    mk = _names(its, "megakernel")
    assert mk[:2] == ["compile", "build"] and mk[-1] == "save"
    for point in ("shard8 T=16 ctx=2048", "shard8 T=1 ctx=2048", "small T=16 ctx=512", "small T=1 ctx=512"):
        for impl in ("chain", "mega"):
            assert f"{point} {impl}" in mk
        # the naive torch expressions only with --full or --classes model (H200 2026-12-01: ~36 s of the
        # budget at small, out of memory at shard8 beside the megakernel's weights)
        assert not [n for n in mk if n.startswith(point) and n.endswith((" eager", " graph", " compile"))]
    assert "shard8 T=16 ctx=2048 peer" in mk and not [n for n in mk if n.endswith(" acceptance")]
    assert {"shard8 check T=16 ctx=2500", "shard8 check T=1 ctx=300", "tiny check T=1 ctx=0", "small greedy",
            "tiny greedy"} <= set(mk)
    # checks before timings (a failed check skips its preset's timings: same group)
    assert mk.index("shard8 check T=16 ctx=2500") < mk.index("shard8 T=1 ctx=2048 chain")
    by = {i.name: i for i in its if i.stage == "megakernel"}
    assert by["shard8 check T=16 ctx=2500"].groups == by["shard8 T=16 ctx=2048 mega"].groups
    assert not [n for n in mk if "ablation" in n or "timeline" in n or "8192" in n or "4096" in n]
    assert next(i for i in its if i.stage == "cross-GPU microbenchmarks").skip == "1 GPU on this node"


def test_full_adds_the_ablation_timelines_and_long_contexts(gpu_wiring, tmp_path):
    from megakernel.plans import ablation_names

    mk = _names(pipeline.items(_args(full=True), tmp_path, gpu=True), "megakernel")
    names = ablation_names()
    assert len(names) == 13 and "mega+all_single_launch" in names
    assert [n for n in mk if " ablation " in n] == [f"{p} ablation {v}" for p in ("small", "shard8") for v in names]
    assert "shard8 timeline" in mk and "shard8 timeline detail" in mk
    assert {"shard8 T=16 ctx=8192 mega", "shard8 T=16 ctx=8192 eager", "small T=1 ctx=4096 compile"} <= set(mk)
    # the batched steps (plans.BATCH_FULL; T = 16 at B = 2, 4, 8 in row groups, their experts over
    # the union of their routing), chain and mega, then the peer at the same B, --full only
    grid = ((2, 1), (4, 1), (8, 1), (2, 8), (4, 4), (2, 16), (4, 16), (8, 16))
    assert [n for n in mk if " B=" in n and n.startswith("shard8") and "decode" not in n] == [
        f"shard8 B={b} T={t} ctx=2048 {m}" for b, t in grid for m in ("chain", "mega")] + [
        f"shard8 B={b} T={t} ctx=2048 peer" for b, t in grid]
    # the batched speculative decodes, trees of 16 / B and full trees, --full only
    assert [n for n in mk if n.startswith("shard8 speculative decode")] == ["shard8 speculative decode"] + [
        f"shard8 speculative decode B={b}{t}" for b in (4, 8) for t in ("", " full trees")]
    assert not [n for n in _names(pipeline.items(_args(), tmp_path, gpu=True), "megakernel") if " B=" in n]


def test_classes_model_runs_the_naive_baselines(gpu_wiring, tmp_path):
    mk = _names(pipeline.items(_args(classes=["model"]), tmp_path, gpu=True), "megakernel")
    assert {"shard8 acceptance", "shard8 T=16 ctx=2048 eager", "small T=1 ctx=512 compile"} <= set(mk)


def test_classes_without_model_run_no_baselines(gpu_wiring, tmp_path):
    its = pipeline.items(_args(classes=["sync"]), tmp_path, gpu=True)
    assert all(n.startswith("sync.") for n in _names(its, "microbenchmarks"))
    mk = _names(its, "megakernel")
    assert "shard8 T=16 ctx=2048 mega" in mk and not [n for n in mk if n.endswith((" eager", " acceptance"))]


def test_default_plan_fits_the_budget_on_its_seeds(gpu_wiring, tmp_path):
    """The seeds are the first run's estimate (before any run.wall result): work added to the
    default must come with seeds that still fit, or go to --full."""
    its = pipeline.items(_args(), tmp_path, gpu=True)
    est = Estimates.load(H200, True, [], *_seeds())
    pr = Progress(its, est, pipeline.BUDGET_S)
    assert {est.of(i).source for i in its} <= {"seed", "work size", "skipped"}
    assert 150 < pr.total_estimate() <= pipeline.BUDGET_S, pr.total_estimate()


def _seeds():
    from megakernel import pipeline as mk

    return ({**pipeline.SEEDS, **{f"megakernel/{k}": v for k, v in mk.SEEDS.items()}},
            {**pipeline.KIND_SEEDS, **mk.KIND_SEEDS})


# ------------------------------------------------------------------------- progress
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _stand_ins(clock, log):
    def work(name, s, fail=False):
        def fn():
            log.append(name)
            clock.t += s
            if fail:
                raise RuntimeError(f"{name} broke")
        return fn

    return [Item("micro", "a", work("a", 2.0), "k"),
            Item("micro", "b", work("b", 1.0, fail=True), "k"),
            Item("xgpu", "x", None, skip="1 GPU on this node"),
            Item("mega", "check", work("check", 3.0, fail=True), groups=("mega/p",)),
            Item("mega", "time", work("time", 5.0), groups=("mega/p",)),
            Item("mega", "other", work("other", 4.0), groups=("mega/q",)),
            Item("mega", "save", work("save", 0.5), groups=("mega/p",), always=True)]


def test_progress_lines_give_stage_item_elapsed_and_remainder():
    clock, log, lines = Clock(), [], []
    its = _stand_ins(clock, log)
    est = Estimates({"micro/a": 2.5}, seeds={"mega/check": 3.0}, kind_seeds={"k": 1.5, "": 4.0}, last_run="r0")
    pr = Progress(its, est, budget_s=300, out=lines.append, clock=clock)
    assert pr.total_estimate() == 2.5 + 1.5 + 0 + 3.0 + 4.0 + 4.0 + 4.0
    done = pr.run()
    assert log == ["a", "b", "check", "other", "save"]  # "time" skipped after its group's check failed
    text = "\n".join(lines)
    assert lines[0] == ("plan: 6 items in 3 stages, estimated 19 s (budget 300 s); estimates: 1 from the last run "
                        "(r0), 4 from work size, 1 from seed")
    assert "  xgpu: skipped (1 GPU on this node)" in lines
    assert "-- micro: 2 items, ~4 s" in lines and "-- xgpu" not in text
    assert "[  1/7     0.0 s] micro: a (est 2.5 s)" in lines
    # after a: 16.5 s of estimates left; elapsed 2 s + 16.5 = ~18 s projected
    assert "[  1/7     2.0 s] micro: a done in 2.0 s; ~16 s left, ~18 s of 300 s" in lines
    assert "[  2/7     3.0 s] micro: b FAILED after 1.0 s: RuntimeError: b broke" in lines
    assert "[  3/7     3.0 s] xgpu: x: skipped (1 GPU on this node)" in lines
    assert "[  5/7     6.0 s] mega: time: skipped (an earlier item of mega/p failed (check))" in lines
    # after the failed check, "time" (its group) no longer counts in the remainder; "save" (always) does
    assert "[  6/7    10.0 s] mega: other done in 4.0 s; ~4 s left, ~14 s of 300 s" in lines
    assert "[  7/7    10.5 s] mega: save done in 0.5 s; ~0 s left, ~10 s of 300 s" in lines
    over, c = [], Clock()
    Progress(_stand_ins(c, []), est, budget_s=12, out=over.append, clock=c).run()
    assert "[  1/7     2.0 s] micro: a done in 2.0 s; ~16 s left, ~18 s of 12 s (over the budget)" in over
    assert "[  7/7    10.5 s] mega: save done in 0.5 s; ~0 s left, ~10 s of 12 s" in over
    assert [d.status for d in done] == ["done", "failed", "skipped", "failed", "skipped", "done", "done"]
    assert [d.item.name for d in pr.failed] == ["b", "check"]


def test_run_wall_result_measures_the_budget_like_any_figure(tmp_path, monkeypatch):
    monkeypatch.setattr("microbench.results.Env.capture", classmethod(lambda cls, gpu_index=0: env()))
    clock, log = Clock(), []
    pr = Progress(_stand_ins(clock, log), Estimates(kind_seeds={"": 2.0}), budget_s=300, out=lambda s: None,
                  clock=clock)
    pr.run()
    r = pr.result(quick=True, budget_note="the 5-minute budget")
    p = r.save(tmp_path)
    assert p.parent == tmp_path / "run" and p.name.startswith(f"{BENCHMARK}-")
    got = load(p)
    names = [s.name for s in got.series]
    assert names == ["item/micro/a", "item/micro/b", "item/mega/check", "item/mega/other", "item/mega/save",
                     "stage/micro", "stage/mega", "total"]
    a = got.series_named("item/micro/a")
    assert a.samples == (2.0,) and a.timer == "host" and a.metrics["estimate_s"] == 2.0
    assert a.metrics["estimate_source"] == "work size" and a.metrics["gate_direction"] == "none"
    assert got.series_named("item/micro/b").metrics["failed"]
    assert got.series_named("stage/mega").samples == (7.5,) and got.series_named("stage/mega").metrics["failed_items"] == 1
    total = got.series_named("total")
    assert total.samples == (10.5,) and total.bound.value == 300 and total.bound.source == "the 5-minute budget"
    assert total.achieved == 10.5 and total.fraction_of_bound == pytest.approx(300 / 10.5)
    assert got.derived["budget_fraction_used"].value == pytest.approx(10.5 / 300)
    assert any(n.startswith("FAILED micro/b: RuntimeError") for n in got.notes)
    assert any(n.startswith("skipped mega/time") for n in got.notes)
    # the gate lists a run's wall time as not gated (it is no kernel's performance)
    rep = compare(load_measurements(p), load_measurements(p))
    assert rep.verdicts and {v.verdict for v in rep.verdicts} == {"not gated"}


def _wall(root, gpu=H200, date="2026-12-02T10:00:00Z", quick=True, items=None, sha="abc1234", monkeypatch=None):
    clock = Clock()
    its = [Item("micro", n, (lambda s=s: setattr(clock, "t", clock.t + s)), "k") for n, s in (items or {}).items()]
    pr = Progress(its, Estimates(), out=lambda s: None, clock=clock)
    pr.run()
    monkeypatch.setattr("microbench.results.Env.capture",
                        classmethod(lambda cls, gpu_index=0: env(gpu=gpu, date=date, sha=sha)))
    return pr.result(quick=quick).save(root)


def test_estimates_come_from_the_newest_run_of_this_gpu_and_mode(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    _wall(a, date="2026-12-01T10:00:00Z", items={"x": 1.0, "y": 2.0}, monkeypatch=monkeypatch)
    _wall(b, date="2026-12-02T10:00:00Z", items={"x": 7.0}, sha="def5678", monkeypatch=monkeypatch)
    _wall(b, date="2026-12-03T10:00:00Z", items={"x": 50.0}, quick=False, monkeypatch=monkeypatch)  # --full
    _wall(b, gpu="NVIDIA GB300", date="2026-12-04T10:00:00Z", items={"x": 90.0}, monkeypatch=monkeypatch)
    (b / "run" / "run.wall-20261205T000000Z-nvidia-h200-x.json").write_text('{"schema": "megabench.res')  # torn
    est = Estimates.load(H200, True, [a, b, tmp_path / "missing"], seeds={"micro/y": 3.0, "micro/z": 4.0},
                         kind_seeds={"k": 0.5})
    assert est.last_run == "2026-12-02T10:00:00Z of def5678"
    x, y, z = (Item("micro", n, None, "k") for n in "xyz")
    assert est.of(x).seconds == 7.0 and est.of(x).source == "last run"
    assert est.of(y).seconds == 3.0 and est.of(y).source == "seed"  # the newest run did not have it
    assert est.of(Item("micro", "w", None, "k", size=4)).seconds == 2.0  # the work's size
    assert Estimates.load(H200, False, [b]).of(x).seconds == 50.0
    assert Estimates.load("NVIDIA H100", True, [a, b]).measured == {}


def test_plan_flag_prints_the_estimate_and_runs_nothing(tmp_path, capsys, monkeypatch):
    from reports.cli import main

    monkeypatch.setattr("reports.run.no_gpu_reason", lambda: "test: no driver")
    rc = main(["run", "--plan", "--results", str(tmp_path), "--no-report"])
    out = capsys.readouterr().out
    assert rc == 0 and "plan: 1 item in 5 stages" in out and "  tune/tune: 3.0 s (seed)" in out
    assert "done in" not in out and list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two spawned interpreters and the small preset's builds (cold cache: ~1.5 min here)
def test_stage_compiles_every_build_its_items_ask_for_in_spawned_processes(monkeypatch):
    """The compile item on the CPU (NVRTC needs no GPU): the builds the tiny and small items use,
    compiled by two spawned processes into the kernel cache, where the items then find them."""
    import types

    from megakernel.build import build_gpu
    from megakernel.pipeline import Stage
    from microbench.results import REPO_ROOT
    from microbench.tune import load_constants

    st = Stage(quick=True, presets=("tiny", "small"), ablate=False, log=lambda *a: None, compile_workers=2,
               constants=load_constants(REPO_ROOT / "tests" / "fixtures" / "constants" / "nvidia-h200.json"))
    st._h = types.SimpleNamespace(info=types.SimpleNamespace(sm_count=132, name=H200))
    plans = st.plans_needed()
    assert plans[0] == st.plan("tiny") and {st.plan("small", t) for t in (1, 16)} <= set(plans)
    assert len(plans) == len(set(plans)) >= 2
    assert st._compile() == len(plans)
    monkeypatch.setattr("cuda.core.Program", lambda *a, **k: pytest.fail("not in the cache after the compile item"))
    for p in plans:
        assert build_gpu(p).usage.code_bytes > 0


# ------------------------------------------------------------------------- the megakernel stage's wiring
@pytest.fixture
def fake_gpu_work(monkeypatch):
    """megakernel.pipeline.Stage with every GPU call replaced by a recording stand-in."""
    import types

    import megakernel.measure as measure
    import megakernel.pipeline as mp
    from megakernel.measure import Check
    from megakernel.results_names import step_params, step_series_name
    from microbench.errors import CorrectnessError
    from microbench.results import Bound, Result, Series

    calls = []
    monkeypatch.setattr("microbench.results.Env.capture", classmethod(lambda cls, gpu_index=0: env()))

    def series(p, t, ctx, impl, median):
        return Series.from_samples(step_series_name(p, t, ctx, impl), [median] * 10, timer="cuda_event", unit="s",
                                   params=step_params(p, t, ctx, impl, 8), metrics={"launches_per_step": 1},
                                   bound=Bound("time", 5e-4, "s", "roofline (test)"))

    def check_point(p, t, ctx, plan):
        calls.append(("check", p, t, ctx, plan))
        if (p, t) == ("shard8", 16):
            raise CorrectnessError("shard8 T=16: mega and chain modes differ bitwise")
        return Check(p, t, ctx, 1e-3, True, True, True, True)

    def bench_point(h, p, t, ctx, plan, mode, ceiling, impl=None, program_mode="layer"):
        calls.append(("time", p, t, ctx, mode, plan))
        return series(p, t, ctx, impl or mode, 2e-3 if mode == "chain" else 1e-3)

    class Collector:
        def __init__(self, quick=None, strict=False):
            self.series = []

        def acceptance(self, p):
            calls.append(("acceptance", p))

        def case(self, p, t, ctx, b):
            calls.append(("baseline", p, t, ctx, b))
            self.series.append(series(p, t, ctx, b, 5e-3))
            return self.series[-1]

        def result(self, save=True):
            return Result("model.baselines", env(), tuple(self.series))

    def peer(name, quick_tokens=None):  # a registered peer row (megakernel.pipeline.PEERS), recorded
        def fn(h, p, t, ctx, ceiling, constants=None):
            calls.append(("peer", name, p, t, ctx))
            return series(p, t, ctx, name, 1.5e-3)
        if quick_tokens:
            fn.quick_tokens = quick_tokens
        return fn

    monkeypatch.setattr(mp, "PEERS", {"peer": peer("peer", (16,)), "other": peer("other")})
    monkeypatch.setattr(mp, "plan_for", lambda p, c=None, sm=None, **kw: ("plan", p, tuple(sorted(kw.items()))))
    monkeypatch.setattr(measure, "plan_for", mp.plan_for)  # ablation_point plans and times in megakernel.measure
    monkeypatch.setattr(measure, "bench_point", bench_point)
    monkeypatch.setattr(mp, "check_point", check_point)
    monkeypatch.setattr(mp, "bench_point", bench_point)
    def bench_batch_point(h, p, b, t, ctx, plan, mode, ceiling):
        calls.append(("time_batch", p, b, t, ctx, mode, plan))
        return Series.from_samples(f"{p}/B{b}/T{t}/ctx{ctx}/{mode}", [1e-3 if mode == "mega" else 2e-3] * 10,
                                   timer="cuda_event", unit="s", params=step_params(p, t, ctx, mode, 8, batch=b))

    monkeypatch.setattr(mp, "bench_batch_point", bench_batch_point)

    def peer_batch(h, p, b, t, ctx, ceiling):  # the peer at a batched point (megakernel.pipeline.BATCH_PEERS)
        calls.append(("peer_batch", p, b, t, ctx))
        return Series.from_samples(f"{p}/B{b}/T{t}/ctx{ctx}/peer", [3e-3] * 10, timer="cuda_event", unit="s",
                                   params=step_params(p, t, ctx, "peer", 8, batch=b))

    monkeypatch.setattr(mp, "BATCH_PEERS", {"peer": peer_batch})
    monkeypatch.setattr(mp, "greedy_check", lambda p, plan: calls.append(("greedy", p)) or 64)
    monkeypatch.setattr(mp.Stage, "_decode", lambda self, p, batch=1, full=False: calls.append(
        ("decode", p) if batch == 1 else ("decode", p, batch, full)))
    monkeypatch.setattr(mp.Stage, "draft_plan", lambda self, p, groups=1: (
        "plan", f"{p} drafter", (("row_groups", groups),) if groups > 1 else ()))
    monkeypatch.setattr(mp, "build_result", lambda plans, budget: Result("megakernel.build", env(), ()))
    monkeypatch.setattr(mp, "code_budget", lambda c=None: 96 * 1024)
    # the code per op beside the build, as on a machine with nvdisasm (the H200 has one; CI may not)
    monkeypatch.setattr(mp, "find_nvdisasm", lambda: "/fake/nvdisasm")
    monkeypatch.setattr(mp, "code_result", lambda points, n_sm, c=None: calls.append(("code", tuple(points)))
                        or Result("megakernel.code", env(), ()))
    monkeypatch.setattr(mp, "timeline", lambda h, p, t, ctx, c, log=None, detail=False: Result(
        "megakernel.timeline_detail" if detail else "megakernel.timeline", env(), ()))
    monkeypatch.setattr(mp, "_one", lambda plan: calls.append(("compile", plan)))
    monkeypatch.setattr(mp, "Collector", Collector)
    monkeypatch.setattr(mp, "weights_for", lambda p: calls.append(("weights", p)))
    monkeypatch.setattr(mp, "release", lambda p=None: calls.append(("release", p)))
    monkeypatch.setattr(mp, "read_ceiling", lambda gpu=None: (4.6e12, "test"))
    h = types.SimpleNamespace(info=types.SimpleNamespace(sm_count=132, name=H200))
    return calls, h


def _stage(h, **kw):
    from megakernel.pipeline import Stage

    st = Stage(save=False, log=lambda *a: None, compile_workers=1, **kw)
    st._h = h
    return st


def test_stage_checks_before_timing_and_saves_what_it_measured(fake_gpu_work):
    calls, h = fake_gpu_work
    st = _stage(h, quick=True, ablate=False, baselines=True)
    pr = Progress(st.items(), Estimates(), out=lambda s: None)
    pr.run()
    assert [d.item.name for d in pr.failed] == ["shard8 check T=16 ctx=2500"]
    assert ("code", (("shard8", 16),)) in calls and "megakernel.code" in [r.benchmark for r in st.results]
    timed = [(c[1], c[2], c[4]) for c in calls if c[0] == "time"]
    assert ("small", 16, "mega") in timed and ("small", 1, "chain") in timed
    assert not [t for t in timed if t[0] == "shard8"]  # refused after the failed check
    # the baselines are their own group: still timed at shard8, at the same points
    assert [c[1:] for c in calls if c[0] == "baseline" and c[1] == "shard8"] == [
        ("shard8", t, 2048, b) for t in (1, 16) for b in ("eager", "graph", "compile")]
    assert calls.index(("weights", "shard8")) < calls.index(("check", "shard8", 1, 300, ("plan", "shard8", (("tokens", 1),))))
    assert ("release", "shard8") in calls and ("greedy", "small") in calls
    # the speculative decode after the preset's checks, in its group: refused after shard8's failed check
    assert ("decode", "small") in calls and ("decode", "shard8") not in calls
    assert calls.index(("greedy", "small")) < calls.index(("decode", "small"))
    # the peers (their own group: the peer checks itself) at every timed point, or at their
    # quick_tokens in the quick run, saved with the step
    assert [c[1:] for c in calls if c[0] == "peer" and c[2] == "small"] == [
        ("peer", "small", 16, 512), ("other", "small", 1, 512), ("other", "small", 16, 512)]
    assert ("peer", "peer", "shard8", 16, 2048) in calls  # the failed mega check does not skip the peer's group
    step = next(r for r in st.results if r.benchmark == "megakernel.step")
    assert "small/T16/ctx512/peer" in {s.name for s in step.series}
    compiled = [c[1] for c in calls if c[0] == "compile"]
    assert ("plan", "shard8", (("tokens", 16),)) in compiled and len(compiled) == len(set(compiled))
    assert ("plan", "small drafter", ()) in compiled and ("plan", "shard8 drafter", ()) in compiled
    assert [r.benchmark for r in st.results] == ["megakernel.build", "megakernel.code", "megakernel.step",
                                                 "model.baselines"]
    assert step.derived["speedup_vs_chain/small/T16/ctx512/mega"].value == pytest.approx(2.0)
    assert not [k for k in step.derived if "shard8" in k]
    assert any(n.startswith("checked small T=16 ctx=1500") for n in step.notes)


def test_full_stage_compiles_and_runs_the_ablation_and_timelines(fake_gpu_work):
    from megakernel.plans import ablation_names

    calls, h = fake_gpu_work
    st = _stage(h, quick=False, ablate=True, timeline=True, detail=True, presets=("small",))
    for it in st.items():
        if it.name.startswith("small check"):
            continue  # the stand-in checks pass; keep the calls short
        it.fn()
    impls = [c[4] for c in calls if c[0] == "time" and c[3] == 4096 and c[2] == 16]
    assert impls[:2] == ["chain", "mega"] and len(impls) == 2 + len(ablation_names())
    # the batched speculative decodes: trees of 16 / B, and full trees (a row group per request)
    assert [c for c in calls if c[0] == "decode"] == [("decode", "small")] + [
        ("decode", "small", b, full) for b in (4, 8) for full in (False, True)]
    # the batched steps on the build of their B x T rows, with their own speed-ups and the peer's note
    batched = [c[1:6] for c in calls if c[0] == "time_batch"]
    grid = ((2, 1), (4, 1), (8, 1), (2, 8), (4, 4), (2, 16), (4, 16), (8, 16))
    assert batched == [("small", b, t, 512, m) for b, t in grid for m in ("chain", "mega")]
    # up to 16 rows the build for B x T of them; past 16 row groups of 16 (plans.rows_switches: their
    # experts over the union of the groups' routing, make_plan's default with row groups)
    assert all(c[6] == ("plan", "small", (("tokens", c[2] * c[3]),)) for c in calls
               if c[0] == "time_batch" and c[2] * c[3] <= 16)
    assert all(c[6] == ("plan", "small", (("row_groups", c[2] * c[3] // 16), ("tokens", 16))) for c in calls
               if c[0] == "time_batch" and c[2] * c[3] > 16)
    step = next(r for r in st.results if r.benchmark == "megakernel.step")
    assert step.derived["speedup_vs_chain/small/B4/T1/ctx512/mega"].value == pytest.approx(2.0)
    assert "speedup_vs_chain/small/T1/ctx512/mega" in step.derived
    # the peer at every batched point, saved beside them, mega's speed-up over it at the same B
    assert [c[1:] for c in calls if c[0] == "peer_batch"] == [("small", b, t, 512) for b, t in grid]
    assert {f"small/B{b}/T{t}/ctx512/peer" for b, t in grid} <= {s.name for s in step.series}
    assert step.derived["speedup_vs_peer/small/B4/T1/ctx512/mega"].value == pytest.approx(3.0)
    assert any("the peer at the same B" in n for n in step.notes)
    compiled = [c[1] for c in calls if c[0] == "compile"]
    assert len(compiled) > len(ablation_names())  # every variant's build, before any is timed
    assert {("plan", "small drafter", (("row_groups", b),)) for b in (4, 8)} <= set(compiled)  # full trees' drafters
    assert [r.benchmark for r in st.results] == ["megakernel.build", "megakernel.step"]  # no timeline for small


def test_a_failing_code_step_is_a_note_not_a_failed_build(fake_gpu_work, monkeypatch):
    import megakernel.pipeline as mp

    calls, h = fake_gpu_work

    def broken(points, n_sm, c=None):
        raise RuntimeError("nvdisasm exited 1")

    monkeypatch.setattr(mp, "code_result", broken)
    st = _stage(h, quick=True, ablate=False)
    st._build()
    assert [r.benchmark for r in st.results] == ["megakernel.build"]
    assert st.notes == ["megakernel.code not made: RuntimeError: nvdisasm exited 1"]


@pytest.mark.parametrize("exc", [MemoryError("CUDA out of memory (test)"), KeyboardInterrupt()])
def test_a_failed_item_still_saves_what_was_measured_before_it(fake_gpu_work, monkeypatch, exc):
    """megakernel.pipeline.run (`mk check-and-bench`): after the first failure only the `always`
    items run (releases, save), then the failure raises: a late failure does not lose the
    minutes of GPU time measured before it. An interrupt (a session's `timeout -s INT`) likewise."""
    import megakernel.pipeline as mp

    calls, h = fake_gpu_work
    saved = []
    monkeypatch.setattr(mp.Stage, "h", property(lambda self: h))

    def save(self):
        saved.append([s.name for s in self.series])
        return []

    monkeypatch.setattr(mp.Stage, "_save", save)
    init = mp.Stage.__init__
    monkeypatch.setattr(mp.Stage, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "compile_workers": 1}))

    def peer_batch(h_, p, b, t, ctx, ceiling):
        if (b, t) == (2, 16):
            raise exc
        return mp.Series.from_samples(f"{p}/B{b}/T{t}/ctx{ctx}/peer", [3e-3] * 10, timer="cuda_event", unit="s",
                                      params={})

    monkeypatch.setattr(mp, "BATCH_PEERS", {"peer": peer_batch})
    monkeypatch.setattr(mp, "check_point", lambda p, t, ctx, plan: mp.Check(p, t, ctx, 1e-3, True, True, True, True))
    log = []
    with pytest.raises(type(exc)):
        mp.run(quick=True, save=False, presets=("small",), log=log.append, ablate=False, batches=True)
    assert len(saved) == 1 and "small/B4/T4/ctx512/peer" in saved[0] and "small/B4/T16/ctx512/peer" not in saved[0]
    assert "small/B4/T4/ctx512/mega" in saved[0]
    assert any("B=2 T=16" in line and "FAILED" in line for line in log)
    assert ("release", "small") in calls  # the always items ran
