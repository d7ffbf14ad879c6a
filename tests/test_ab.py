"""megakernel/ab.py: variant parsing, and a whole A/B on the host emulation with a stand-in timer."""
from __future__ import annotations

import shutil

import pytest
import torch

from megakernel import ab, tree
from megakernel.build import CSRC
from megakernel.cli import main
from megakernel.config import ConfigError, preset
from megakernel.plan import make_plan
from megakernel.reference import KVCache, Trace, step
from megakernel.weights import generate
from microbench.errors import CorrectnessError
from microbench.results import load


def test_variants_and_points_parse_or_are_refused_by_name(tmp_path):
    assert ab.parse_variant("base") == ab.Variant("base")
    v = ab.parse_variant("k48:keys_per_split=48,pdl=true,note=x,f=0.5")
    assert v.switch_dict == {"keys_per_split": 48, "pdl": True, "note": "x", "f": 0.5} and v.csrc is None
    tree_dir = tmp_path / "csrc"
    shutil.copytree(CSRC, tree_dir)
    assert ab.parse_variant(f"edit={tree_dir}:pdl=false") == ab.Variant("edit", tree_dir.resolve(), (("pdl", False),))
    with pytest.raises(ConfigError, match="not a kernel source tree"):
        ab.parse_variant(f"x={tmp_path}")
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        ab.parse_variant("x:keys_per_split")
    with pytest.raises(ConfigError, match="plain name"):
        ab.parse_variant("=foo")
    assert ab.parse_point("shard8:16:2048") == ("shard8", 16, 2048)
    assert ab.parse_point("small:16:512:8") == ("small", 16, 512, 8)
    assert ab.point_parts(("small", 16, 512)) == ("small", 16, 512, 1)
    with pytest.raises(ConfigError, match="PRESET:T:CTX"):
        ab.parse_point("shard8:16")
    with pytest.raises(ConfigError, match="PRESET:T:CTX:B"):
        ab.parse_point("shard8:16:2048:8:1")
    with pytest.raises(ConfigError, match="B must be a positive"):
        ab.parse_point("shard8:16:2048:0")
    assert main(["ab", "--variant", "x:oops", "--build-only"]) == 2  # a bad variant: exit 2, no traceback


def test_a_switch_that_is_no_plan_switch_is_refused_before_anything_is_built(capsys):
    """A misspelt switch, or one of a lever removed from the code, stops the A/B by name before
    the first build (an A/B command of an old note would otherwise fail after minutes of builds)."""
    with pytest.raises(ConfigError, match="variant pre: prestage_experts is no Plan switch"):
        ab.check_switches([ab.Variant("base"), ab.parse_variant("pre:prestage_experts=8")])
    ab.check_switches([ab.parse_variant("k48:keys_per_split=48,layout_pad=1024,compute_registers=0")])
    assert main(["ab", "--variant", "base", "--variant", "r:roles=3,kepe_units=2", "--build-only"]) == 2
    err = capsys.readouterr().err
    assert "variant r: kepe_units, roles are no Plan switches" in err and "reports/LEVERS.md" in err
    with pytest.raises(ConfigError, match="receive_warp"):
        ab.run_ab([("tiny", 1, 0)], [ab.Variant("a"), ab.parse_variant("w:receive_warp=true")], backend="emu",
                  context=lambda *a: pytest.fail("checked before any step"))


def _tiny_context(cfg, w):
    def context(preset_name, t, ctx):
        cache0 = KVCache(cfg).fill_random(torch.Generator().manual_seed(4))
        g = torch.Generator().manual_seed(t + ctx)
        toks = torch.randint(0, cfg.vocab, (t,), generator=g)
        par = tree.binary_ish(t) if t > 1 else [-1]
        tr = Trace()
        ref = step(w, cache0.clone(), toks, par, ctx, trace=tr)
        routes = [tr.tensors[f"L{l}.route"] for l in range(cfg.n_layers)]
        return w, cache0, toks, par, routes, ref
    return context


def test_a_whole_ab_on_the_emulation_checks_then_times_in_alternating_rounds(tmp_path):
    cfg = preset("tiny")
    w = generate(cfg)
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)  # the same source in another tree: same bits expected
    variants = [ab.Variant("a"), ab.Variant("same", copy), ab.Variant("k16", None, (("keys_per_split", 16),))]
    calls = []
    speed = {"a": 1.0, "same": 1.01, "k16": 0.9}

    def timer():
        def time_one(name, eng):
            calls.append(name)
            return speed[name] * 1e-3 * (1 + 0.001 * len(calls))
        return time_one

    plan_of = lambda p, v, t: make_plan(cfg, 4, spin_bound_ns=3_000_000_000, **v.switch_dict)  # noqa: E731
    res = ab.run_ab([("tiny", 8, 40)], variants, rounds=3, backend="emu", context=_tiny_context(cfg, w),
                    timer=timer, plan_of=plan_of, log=lambda s: None)
    (r,) = res
    assert calls == ["a", "same", "k16", "k16", "same", "a", "a", "same", "k16"]
    assert r.checks["a"].same_as_first and r.checks["same"].same_as_first
    assert all(c.rel_err < 1e-2 for c in r.checks.values())
    assert len(r.rounds["k16"]) == 3 and r.change("k16") == pytest.approx(-0.1, abs=0.01)
    assert r.change("a") == 0.0
    md = ab.table(res)
    assert "| tiny T=8 ctx=40 | k16" in md and "-10." in md
    # the typed result (`ab --save`): every round, the checks, the trees, the switches; read back,
    # it renders the same table (`ab-table`)
    saved = ab.to_result(res, variants, timer="host", notes=("emulated",)).save(tmp_path / "results")
    back = load(saved)
    assert back.benchmark == ab.AB_BENCHMARK and saved.name.startswith("megakernel.ab-")
    s_k16 = back.series_named("tiny/T8/ctx40/k16")
    assert list(s_k16.samples) == r.rounds["k16"] and s_k16.params["switches"] == {"keys_per_split": 16}
    assert s_k16.bound is None  # no roofline without the GPU's context
    trees = {s.params["variant"]: s.params["tree"] for s in back.series}
    assert trees["a"] == trees["same"] == trees["k16"] == ab.tree_id(None) != ab.tree_id(tmp_path / "absent")
    assert back.derived["change_tiny_T8_ctx40_k16"].value == pytest.approx(r.change("k16"))
    assert ab.table(ab.from_result(back)) == md
    assert main(["ab-table", str(saved), "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text() == md + "\n"
    # a variant's name is a different tree in every A/B: the timing gate lists the series, never judges them
    from microbench.gate import judge, load_measurements

    verdicts = [judge(m, m) for m in load_measurements(saved)]
    assert len(verdicts) == 3 and {v.verdict for v in verdicts} == {"not gated"}
    assert all("gate_direction none" in v.reason for v in verdicts)


def test_ab_table_refuses_a_result_that_is_not_an_ab(tmp_path, capsys):
    from microbench.results import Env, Result, Series

    env = Env(None, None, None, None, None, None, None, None, "13.0", "1.2.0", "2.13", "3.11", "abc1234", False,
              "host", "2026-12-01T00:00:00Z")
    other = Result("megakernel.step", env, (Series.from_samples("x", [1.0, 2.0], timer="host", unit="s"),))
    path = other.save(tmp_path)
    assert main(["ab-table", str(path)]) == 2
    assert "not an A/B result" in capsys.readouterr().err
    assert main(["ab-table", str(tmp_path / "missing.json")]) == 2


def test_a_variant_that_breaks_the_result_is_reported_and_not_timed(tmp_path):
    """A variant whose outputs are wrong is checked, reported with the reason and left out of the
    timing rounds; the others are timed as usual (the A/B runs once on the GPU). A broken first
    variant, the reference, stops the A/B."""
    cfg = preset("tiny")
    w = generate(cfg)
    bad = tmp_path / "csrc"
    shutil.copytree(CSRC, bad)
    g = bad / "mk" / "gemm.cuh"
    src = g.read_text()
    scaled = "blk[4 * w + k8 % 4] = hmul2(wd[w], FP4_ACT_SCALE_BF2);"
    assert scaled in src
    g.write_text(src.replace(scaled, "blk[4 * w + k8 % 4] = wd[w];"))  # experts' operand 2^7 too small
    plan_of = lambda p, v, t: make_plan(cfg, 4, spin_bound_ns=3_000_000_000)  # noqa: E731
    timed = []

    def timer():
        return lambda n, e: timed.append(n) or 1.0

    kw = dict(rounds=2, backend="emu", context=_tiny_context(cfg, w), timer=timer, plan_of=plan_of, log=lambda s: None)
    (r,) = ab.run_ab([("tiny", 4, 20)], [ab.Variant("ok"), ab.Variant("bad", bad), ab.Variant("ok2")], **kw)
    assert set(timed) == {"ok", "ok2"} and "bad" not in r.rounds and "bad" not in r.checks
    assert "A/B variant bad" in r.failed["bad"] and r.failed["bad"].startswith("CorrectnessError")
    md = ab.table([r])
    assert "| bad" in md and "CHECK FAILED" in md
    res = ab.to_result([r], [ab.Variant("ok"), ab.Variant("bad", bad), ab.Variant("ok2")], timer="host")
    assert any("variant bad: not timed" in n for n in res.notes) and len(res.series) == 2
    with pytest.raises(CorrectnessError, match="A/B variant bad"):
        ab.run_ab([("tiny", 4, 20)], [ab.Variant("bad", bad), ab.Variant("ok")], **kw)


def test_build_only_compiles_every_variant_without_a_gpu(capsys):
    assert main(["ab", "--variant", "a", "--variant", "k16:keys_per_split=16", "--point", "tiny:1:8",
                 "--point", "tiny:16:8", "--build-only", "--sm", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    # one build per (preset, T, variant): the plan follows T (plan_for tokens)
    assert [line.split(":")[0] for line in out] == ["tiny T=1 a", "tiny T=1 k16", "tiny T=16 a", "tiny T=16 k16"]
    assert all("0 B spill stores" in line for line in out)


def test_ncu_commands_put_only_the_target_launches_inside_the_profiler_range(monkeypatch, capsys):
    """ncu-op and ncu-mega share _launches_profiled: every launch up to the target runs, in
    order, and only the targets sit between cudaProfilerStart and Stop (what `ncu
    --profile-from-start off` profiles)."""
    from megakernel import cli

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))

    class Eng:
        def _launch(self, first, n, wait, grid, li):
            calls.append(li)

    launches = [(10 * i, 1, 1, 132) for i in range(5)]
    cli._launches_profiled(Eng(), launches, {1, 3}, lambda li, first, n, grid: f"launch {li} op {first}")
    assert calls == [0, "start", 1, "stop", 2, "start", 3, "stop", 4]
    assert capsys.readouterr().out.split("\n")[:2] == ["launch 1 op 10", "launch 3 op 30"]


def test_layout_placebos_give_each_variant_a_verdict_that_survives_saving(tmp_path):
    """A variant that differs from the first only by a layout switch is its placebo; every other
    variant's change is judged against the range the first (0) and its placebos span, widened by
    the rounds' spread. The saved result gives the same placebos and table."""
    from microbench.results import Env

    base = ab.Variant("main")
    vs = [base, ab.Variant("gap", None, (("layout_gap", 512),)), ab.Variant("pad", None, (("layout_pad", 1024),)),
          ab.Variant("fast", None, (("keys_per_split", 16),)), ab.Variant("near", None, (("loader_ahead", False),)),
          ab.Variant("slow", None, (("keys_per_split", 64),)),
          ab.Variant("gapfast", None, (("keys_per_split", 16), ("layout_gap", 512)))]
    assert [v.name for v in vs if ab.is_placebo(v, base)] == ["gap", "pad"]
    assert not ab.is_placebo(base, base) and not ab.is_placebo(ab.Variant("z", None, (("layout_gap", 0),)), base)
    ms = {"main": 1.000, "gap": 1.004, "pad": 0.998, "fast": 0.990, "near": 1.0045, "slow": 1.020, "gapfast": 0.99}
    rounds = {n: [m * 1e-3, m * 1.0005e-3, m * 0.9995e-3] for n, m in ms.items()}  # 0.1% spread
    r = ab.PointResult("tiny", 8, 40, {n: ab.Checked(1e-3, True) for n in ms}, rounds, None,
                       tuple(v.name for v in vs[1:] if ab.is_placebo(v, base)))
    assert r.layout_range() == pytest.approx((-0.002, 0.004))
    assert r.verdict("main") == "reference" and r.verdict("gap") == "placebo"
    assert r.verdict("fast").startswith("faster beyond (layout -0.20..+0.40%, rounds 0.10%)")
    assert r.verdict("near").startswith("inside")  # +0.45%: within +0.4% and the rounds' 0.1%
    assert r.verdict("slow").startswith("slower beyond")
    md = ab.table([r])
    assert "| vs layout placebos" in md and "faster beyond" in md
    env = Env(None, None, None, None, None, None, None, None, "13.0", "1.2.0", "2.13", "3.11", "abc1234", False,
              "host", "2026-12-01T00:00:00Z")
    back = ab.from_result(load(ab.to_result([r], vs, env=env, timer="host").save(tmp_path)))
    assert back[0].placebos == ("gap", "pad") and ab.table(back) == md
    # without placebos there is no verdict column
    plain = ab.PointResult("tiny", 8, 40, {"main": r.checks["main"]}, {"main": rounds["main"]})
    assert "placebos" not in ab.table([plain]) and plain.layout_range() is None


def test_a_batched_point_checks_and_times_every_request_of_the_step(tmp_path):
    """PRESET:T:CTX:B: B requests in one step on the build for their B x T rows (past 16: row
    groups), checked (mega == chain bitwise, twice; the reference on every row) and timed like a
    single request's point; here the union build (the default) against the per-group ablation on
    the emulation, a pure speed change (same bits). Saved and read back with its B."""
    from megakernel.batch import make_requests, random_caches
    from megakernel.plans import rows_switches
    from megakernel.reference import step_batch

    cfg = preset("tiny")
    w = generate(cfg)

    def batch_context(preset_name, t, ctx, b):  # the reference's routing, forced in the kernel
        reqs = make_requests(cfg, [(t, ctx + 7 * r) for r in range(b)], seed=5)
        caches0 = random_caches(cfg, b, seed=5)
        traces = [Trace() for _ in reqs]
        ref = step_batch(w, [c.clone() for c in caches0], reqs, traces=traces)
        routes = [torch.cat([tr.tensors[f"L{l}.route"] for tr in traces]) for l in range(cfg.n_layers)]
        return w, caches0, reqs, routes, ref

    calls = []

    def timer():
        def time_one(name, eng):
            calls.append((name, type(eng).__name__))
            return (1.25 if name == "pergroup" else 1.0) * 1e-3
        return time_one

    plan_of = lambda p, v, rows: make_plan(cfg, 4, spin_bound_ns=3_000_000_000,  # noqa: E731
                                           **{**rows_switches(cfg, rows), **v.switch_dict})
    variants = [ab.Variant("base"), ab.parse_variant("pergroup:union_experts=false")]
    (r,) = ab.run_ab([("tiny", 16, 20, 2)], variants, rounds=2, backend="emu", batch_context=batch_context,
                     timer=timer, plan_of=plan_of, log=lambda s: None)
    assert r.batch == 2 and r.label == "tiny T=16 ctx=20 B=2"
    assert calls == [(n, "GroupEngine") for n in ("base", "pergroup", "pergroup", "base")]  # alternating rounds
    assert r.checks["pergroup"].same_as_first and r.change("pergroup") == pytest.approx(0.25)
    assert "| tiny T=16 ctx=20 B=2 | pergroup" in ab.table([r])
    back = load(ab.to_result([r], variants, timer="host").save(tmp_path))
    assert back.series_named("tiny/B2/T16/ctx20/pergroup").params["B"] == 2
    assert "change_tiny_B2_T16_ctx20_pergroup" in back.derived
    assert ab.table(ab.from_result(back)) == ab.table([r])

