"""One side of the in-run A/B gate (microbench/gate_ab.py): a long-lived process that imports ONE
source tree, prepares and checks that tree's benchmark cases once, then times a case each time
the controller asks. Two Python trees cannot share one process (both are `microbench`), so the
controller runs one of these per side and only ever lets one of them time at a time.

    python <this file> --root TREE --backend pytest|synthetic [--spec FILE] [--name WORKER]

Started by the controller, not by hand. It is a script, not a module of the package: it runs from
the controller's tree against another tree's packages (an older revision does not have this
file), so at the top it imports only the standard library; the side's own packages are imported
with the side's root first on sys.path, and the worker checks that they really come from there.

Backends:
- pytest: the tree's own pytest-benchmark cases (tests/bench/test_bench_<class>.py), collected
  and run by pytest in this process with one change: the `benchmark` fixture is a recorder. A
  case's test body runs as usual (the `device_bench` fixture prepares the case: fresh random
  inputs, its correctness check, then `benchmark.pedantic(one_round, ...)`); the recorder runs
  one round so the test completes and keeps the round function, which stays alive with what it
  prepared. A timing request then calls that function: one call is one pytest-benchmark round,
  the time is read from the fixture's own timer (device seconds under `device_bench`), and a
  round that covers several steps (extra_info steps_per_round, older trees) is divided by them.
- synthetic: cases from a JSON spec with a fake timer (a base time, multiplicative noise, a drift
  shared by both sides through the round number, a penalty for timing second in a round, an
  injected slowdown, and `process_sd`: a steady offset of each worker process, drawn once per
  worker name and case, like the memory placement of a real process). It runs everything the controller does on a CPU: pairing, alternation,
  verdicts, failure modes.

Variants (the quality measurement, microbench/gate_quality.py): the same cases prepared again
under other environment variables (MEGABENCH_INJECT_PPM: the build switch of mb/inject.cuh);
case ids then carry "@<variant>".

Protocol: JSON lines. Requests come on stdin; replies go to the original stdout, which is moved
to a private descriptor first, after which fd 1 points at stderr, so nothing the tree prints
(pytest's report, compiler warnings, C libraries) can corrupt the channel.
  first line        <- {"ok": true, "hello": {...}} | {"ok": false, "error": "..."}
  prepare           -> {"cmd": "prepare", "select": {...}, "variants": [{"name", "env"}]}
                    <- {"ok": true, "cases": [{"id", "unit", "class", "info"}], "failed": [...], "skipped": [...]}
  time              -> {"cmd": "time", "case": ID, "samples": K, "round": R, "slot": S}
                    <- {"ok": true, "value": median seconds, "values": [K values]}
  quit              -> {"cmd": "quit"}   <- {"ok": true}
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

PROTOCOL = 1


class CaseError(Exception):
    """A case that cannot be timed by this worker (named in the message)."""


# ----------------------------------------------------------------------------- the side's tree
def _import_tree(root: Path) -> dict:
    """Import the side's packages from `root` (the 'build' of a Python tree: a syntax error, a
    missing module or a failing import is a tree that does not build) and describe its GPU."""
    info: dict = {"root": str(root), "python": sys.version.split()[0], "device": None, "arch": None}
    if not (root / "microbench" / "__init__.py").is_file():
        return info  # a tree without the package (the pytest backend's own tests use such trees)
    import microbench  # noqa: F401  (the side's, by sys.path[0])

    got = Path(microbench.__file__).resolve()
    if root.resolve() not in got.parents:
        raise RuntimeError(f"`import microbench` resolved to {got}, outside the side's tree {root}")
    try:
        from microbench.compiler import DEFAULT_ARCH  # the side's tree, once sys.path names it

        info["arch"] = DEFAULT_ARCH
    except Exception as e:  # an old tree: say so, the controller decides
        info["arch"] = f"unknown ({e.__class__.__name__})"
    try:
        from microbench.device import gpu_count  # the side's tree, once sys.path names it

        if gpu_count() > 0:
            from microbench.device import device_info  # the side's tree, once sys.path names it

            d = device_info(0)
            info["device"] = {"name": d.name, "cc": list(d.cc), "sm_count": d.sm_count,
                              "sm_clock_max_mhz": d.sm_clock_max_mhz, "uuid": getattr(d, "uuid", None),
                              "arch": getattr(d, "arch", None),
                              "gpu_key": f"{d.name}@{d.sm_clock_max_mhz}MHz"}
    except Exception as e:
        info["device_error"] = f"{e.__class__.__name__}: {e}"
    return info


@contextlib.contextmanager
def _env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- pytest backend
class _Stats:
    """What `device_bench` reads back after pedantic(): benchmark.stats.stats.<field>."""

    def __init__(self, dt: float):
        class S:
            pass

        s = S()
        s.median = s.min = s.max = s.mean = max(float(dt), 1e-30)
        s.stddev, s.rounds, s.iterations, s.data = 0.0, 1, 1, [float(dt)]
        self.stats = s


class _Recorder:
    """Stands in for pytest-benchmark's fixture: records the round function instead of running
    the rounds. `_timer` is what the test's fixture installs (device_bench: a DeviceClock)."""

    def __init__(self, nodeid: str, capture: "_Capture"):
        self.nodeid = nodeid
        self.capture = capture
        self.extra_info: dict = {}
        self._timer = None
        self._megabench_after = None  # what device_bench sets: the case's check of its last launches
        self.variant = ""
        self.stats = None
        self.name = nodeid.rsplit("::", 1)[-1]
        self.fullname = nodeid

    def pedantic(self, target, args=(), kwargs=None, setup=None, rounds=1, warmup_rounds=0, iterations=1):
        if setup is not None:
            raise CaseError(f"{self.nodeid}: pedantic(setup=...) is not supported by the A/B worker")
        timer = self._timer or time.perf_counter
        kw = dict(kwargs or {})
        iterations = max(1, int(iterations))

        def one_round():
            for _ in range(iterations):
                target(*args, **kw)

        t0 = timer()
        one_round()  # one round now: the case ran once more after its checks, and the test completes
        dt = (timer() - t0) / iterations
        self.stats = _Stats(dt)
        self.capture.record(self.nodeid, self.variant, one_round, timer, iterations, self.extra_info,
                            getattr(self, "_megabench_after", None))

    def __call__(self, fn, *args, **kwargs):
        return self.pedantic(fn, args, kwargs)

    def weave(self, *a, **k):
        raise CaseError(f"{self.nodeid}: benchmark.weave is not supported by the A/B worker")


class _Capture:
    """pytest plugin of the worker: the recorder as `benchmark`, each test body run once per
    variant under its environment, every outcome kept (nothing dropped silently)."""

    def __init__(self, variants: list[dict], ids: list[str] | None = None):
        self.variants = variants or [{"name": "", "env": {}}]
        self.ids = set(ids) if ids else None  # exact nodeids to keep (None: every collected test)
        self.collected: set[str] = set()
        self.cases: dict[str, dict] = {}
        self.failed: list[dict] = []
        self.skipped: list[dict] = []

    def record(self, nodeid, variant, fn, timer, iterations, extra_info, after=None):
        cid = nodeid + (f"@{variant}" if variant else "")
        if cid in self.cases:
            raise CaseError(f"{cid}: the test body asked for more than one benchmark; one per test")
        self.cases[cid] = {"fn": fn, "timer": timer, "iterations": iterations, "info": extra_info,
                           "nodeid": nodeid, "variant": variant, "after": after}

    def _id(self, nodeid, variant):
        return nodeid + (f"@{variant}" if variant else "")

    recorder = _Recorder  # a subclass of pytest-benchmark's fixture class (_capture_plugin)

    def fixture_setup(self, fixturedef, request):
        if fixturedef.argname != "benchmark":
            return None
        rec = self.recorder(request.node.nodeid, self)
        fixturedef.cached_result = (rec, fixturedef.cache_key(request), None)  # what pytest's own setup stores
        return rec

    def pyfunc_call(self, pyfuncitem):
        import pytest  # the pytest backend only: the worker's top imports only the standard library

        if "benchmark" not in pyfuncitem.fixturenames:
            self.skipped.append({"id": pyfuncitem.nodeid, "reason": "not a benchmark (no benchmark fixture)"})
            return True
        rec = pyfuncitem.funcargs["benchmark"]
        testargs = {a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}
        for v in self.variants:
            if v.get("only") is not None and pyfuncitem.nodeid not in v["only"]:
                continue  # a variant for some cases only (e.g. builds with an injection hook)
            cid = self._id(pyfuncitem.nodeid, v["name"])
            rec.variant, rec.extra_info = v["name"], {}
            try:
                with _env(v.get("env") or {}):
                    pyfuncitem.obj(**testargs)
                if cid not in self.cases:
                    self.failed.append({"id": cid, "error": "the test ran but never called benchmark()/pedantic()"})
            except pytest.skip.Exception as e:
                self.skipped.append({"id": cid, "reason": str(e)})
            except Exception as e:
                self.failed.append({"id": cid, "error": f"{e.__class__.__name__}: {e}",
                                    "traceback": traceback.format_exc()[-4000:]})
        return True

    def pytest_collection_modifyitems(self, session, config, items):
        self.collected = {it.nodeid for it in items}
        if self.ids is not None:
            items[:] = [it for it in items if it.nodeid in self.ids]

    def pytest_runtest_logreport(self, report):
        if report.when in ("setup", "teardown") and report.failed:
            for v in self.variants:
                self.failed.append({"id": self._id(report.nodeid, v["name"]),
                                    "error": f"{report.when} failed: {report.longreprtext[-3000:]}"})
        elif report.when == "setup" and report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            for v in self.variants:
                self.skipped.append({"id": self._id(report.nodeid, v["name"]), "reason": str(reason)})

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed.append({"id": report.nodeid or "<collection>",
                                "error": f"collection failed: {report.longreprtext[-3000:]}"})


def _capture_plugin(variants: list[dict], ids: list[str] | None = None) -> _Capture:
    """The plugin object: the two hooks that must run before pytest's own (tryfirst), and a
    recorder that pytest-benchmark's own hooks accept as its fixture (they check the type)."""
    import pytest  # the pytest backend only: the worker's top imports only the standard library

    try:
        from pytest_benchmark.fixture import BenchmarkFixture  # the pytest backend only, as pytest
    except ImportError:  # no pytest-benchmark: nothing checks the type
        BenchmarkFixture = object  # noqa: N806

    class Recorder(_Recorder, BenchmarkFixture):
        def __init__(self, nodeid, capture):
            _Recorder.__init__(self, nodeid, capture)

    class Plugin(_Capture):
        recorder = Recorder

        @pytest.hookimpl(tryfirst=True)
        def pytest_fixture_setup(self, fixturedef, request):
            return self.fixture_setup(fixturedef, request)

        @pytest.hookimpl(tryfirst=True)
        def pytest_pyfunc_call(self, pyfuncitem):
            return self.pyfunc_call(pyfuncitem)

    return Plugin(variants, ids)


def _class_of(nodeid: str) -> str:
    stem = Path(nodeid.split("::", 1)[0]).stem
    return stem[len("test_bench_"):] if stem.startswith("test_bench_") else stem


class PytestBackend:
    def __init__(self, root: Path):
        self.root = root
        self.capture: _Capture | None = None

    def prepare(self, select: dict, variants: list[dict]) -> dict:
        import pytest  # the pytest backend only: the worker's top imports only the standard library

        bench = self.root / "tests" / "bench"
        classes = select.get("classes") or []
        ids = select.get("ids") or None
        missing_classes = []
        if ids:  # exact cases: their files, the rest deselected by the plugin (a missing id is reported)
            paths = sorted({str(self.root / i.split("::", 1)[0]) for i in ids
                            if (self.root / i.split("::", 1)[0]).is_file()})
        elif classes:
            paths = []
            for c in classes:
                p = bench / f"test_bench_{c}.py"
                (paths if p.is_file() else missing_classes).append(str(p) if p.is_file() else c)
        else:
            paths = [str(bench)] if bench.is_dir() else []
        if not paths:
            raise CaseError(f"{self.root}: no pytest-benchmark cases (tests/bench/test_bench_<class>.py) for "
                            f"classes {classes or 'any'}")
        self.capture = _capture_plugin(variants, ids)
        # in this process, whatever the tree's addopts say: `-n auto` (pytest-xdist) would run the
        # tests in other processes, where this plugin does not record them
        args = [*paths, "-q", "-p", "no:cacheprovider", "--rootdir", str(self.root), "-o", "addopts=",
                "-o", "console_output_style=classic"]
        if select.get("k"):
            args += ["-k", select["k"]]
        if select.get("m"):
            args += ["-m", select["m"]]
        rc = pytest.main(args, plugins=[self.capture])
        cases = []
        for cid, c in self.capture.cases.items():
            info = {k: v for k, v in c["info"].items() if isinstance(v, (int, float, str, bool)) or v is None}
            cases.append({"id": cid, "nodeid": c["nodeid"], "variant": c["variant"], "unit": "s",
                          "class": _class_of(c["nodeid"]), "info": info,
                          "timer": info.get("timer", "host (perf_counter)" if c["timer"] is time.perf_counter
                                            else "the fixture's timer")})
        missing_ids = sorted(set(ids or ()) - self.capture.collected)
        return {"cases": cases, "failed": self.capture.failed, "skipped": self.capture.skipped,
                "missing_classes": missing_classes, "missing_ids": missing_ids, "pytest_rc": int(rc)}

    def time(self, cid: str, k: int, rnd: int, slot: int) -> list[float]:
        c = (self.capture.cases if self.capture else {}).get(cid)
        if c is None:
            raise CaseError(f"no prepared case {cid!r}")
        info, timer, fn = c["info"], c["timer"], c["fn"]
        steps = info.get("steps_per_round") if info.get("time_per") != "step" else 1
        div = float(steps) if isinstance(steps, (int, float)) and steps and steps > 0 else 1.0
        div *= c["iterations"]
        fn()  # one round outside the figures: the other side just ran, this one warms up again
        out = []
        for _ in range(k):
            t0 = timer()
            fn()
            out.append((timer() - t0) / div)
        if c.get("after") is not None:
            c["after"]()  # the case's check of its last launches (device_bench's Prepared.after)
        return out


# ----------------------------------------------------------------------------- synthetic backend
def k_match(expr: str, name: str) -> bool:
    """pytest's -k rule on one name: words are case-insensitive substrings, joined by and / or /
    not and parentheses."""
    toks = re.findall(r"\(|\)|[^\s()]+", expr)
    py = []
    for t in toks:
        if t in ("and", "or", "not", "(", ")"):
            py.append(t)
        else:
            py.append(repr(t.lower() in name.lower()))
    try:
        return bool(eval(" ".join(py) or "True", {"__builtins__": {}}, {}))  # only True/False/and/or/not
    except SyntaxError:
        raise CaseError(f"-k {expr!r}: not an expression of words, and, or, not, parentheses") from None


class SyntheticBackend:
    """Fake cases with a fake timer (module docstring). Spec keys: device, cases {id: {time, noise,
    slowdown, class, unit, fail, fail_worker, skip, process_sd}}, drift {amp, period}, order_penalty,
    inject_efficiency, process_sd (each worker's steady offset, log sd), seed, sleep_s (wall time
    per timing, to exercise timeouts)."""

    def __init__(self, spec: dict, name: str = ""):
        self.spec = spec
        self.name = name
        self.cases: dict[str, dict] = {}
        self.calls = 0

    def _process_offset(self, cid: str) -> float:
        base = cid.split("@", 1)[0]  # every variant of a case in one process shares its placement
        sd = float((self.spec.get("cases") or {}).get(base, {}).get("process_sd", self.spec.get("process_sd", 0.0)))
        if not sd:
            return 1.0
        return math.exp(sd * random.Random(f"{self.spec.get('seed', 0)}:{self.name}:{base}:process").gauss(0.0, 1.0))

    def prepare(self, select: dict, variants: list[dict]) -> dict:
        classes = select.get("classes") or []
        k = select.get("k")
        ids = set(select.get("ids") or ())
        cases, failed, skipped = [], [], []
        known = self.spec.get("cases") or {}
        for cid, c in sorted(known.items()):
            cls = c.get("class", "synthetic")
            if classes and cls not in classes:
                continue
            if k and not k_match(k, cid):
                continue
            if ids and cid not in ids:
                continue
            for v in variants or [{"name": "", "env": {}}]:
                if v.get("only") is not None and cid not in v["only"]:
                    continue
                vid = cid + (f"@{v['name']}" if v["name"] else "")
                if c.get("fail") or (c.get("fail_worker") and c["fail_worker"] == self.name):
                    failed.append({"id": vid, "error": str(c.get("fail") or f"fails on worker {self.name}")})
                    continue
                if c.get("skip"):
                    skipped.append({"id": vid, "reason": str(c["skip"])})
                    continue
                ppm = float((v.get("env") or {}).get("MEGABENCH_INJECT_PPM") or 0)
                if ppm and not c.get("inject", True):
                    ppm = 0.0  # a case whose kernels have no injection hook
                eff = float(self.spec.get("inject_efficiency", 1.0))
                self.cases[vid] = {**c, "inject": ppm * 1e-6 * eff, "base_id": cid}
                cases.append({"id": vid, "nodeid": cid, "variant": v["name"], "unit": c.get("unit", "s"),
                              "class": cls, "info": {"case": cid, "timer": "synthetic"}, "timer": "synthetic"})
        return {"cases": cases, "failed": failed, "skipped": skipped, "missing_classes": [],
                "missing_ids": sorted(ids - set(known)), "pytest_rc": 0}

    def time(self, cid: str, k: int, rnd: int, slot: int) -> list[float]:
        c = self.cases.get(cid)
        if c is None:
            raise CaseError(f"no prepared case {cid!r}")
        if self.spec.get("sleep_s"):
            time.sleep(float(self.spec["sleep_s"]))
        drift = self.spec.get("drift") or {}
        amp, period = float(drift.get("amp", 0.0)), float(drift.get("period", 7.0))
        common = 1.0 + amp * math.sin(2 * math.pi * rnd / period)  # the machine's state: both sides alike
        order = 1.0 + float(self.spec.get("order_penalty", 0.0)) * (1 if slot > 0 else 0)
        base = (float(c.get("time", 1e-3)) * (1.0 + float(c.get("slowdown", 0.0)) + c["inject"]) * common * order
                * self._process_offset(cid))
        noise = float(c.get("noise", 0.01))
        out = []
        for i in range(k):
            self.calls += 1
            g = random.Random(f"{self.spec.get('seed', 0)}:{self.name}:{cid}:{rnd}:{slot}:{i}:{self.calls}").gauss(0.0, 1.0)
            out.append(base * math.exp(noise * g))
        return out


# ----------------------------------------------------------------------------- main loop
def _serve(backend, chan_out, chan_in) -> None:
    def reply(obj):
        chan_out.write(json.dumps(obj) + "\n")
        chan_out.flush()

    for line in chan_in:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "quit":
                reply({"ok": True})
                return
            if cmd == "prepare":
                reply({"ok": True, **backend.prepare(req.get("select") or {}, req.get("variants") or [])})
            elif cmd == "time":
                vals = backend.time(req["case"], int(req.get("samples", 1)), int(req.get("round", 0)),
                                    int(req.get("slot", 0)))
                if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
                    raise CaseError(f"{req['case']}: the timer gave non-positive or non-finite values {vals[:4]}")
                reply({"ok": True, "value": statistics.median(vals), "values": vals})
            else:
                reply({"ok": False, "error": f"unknown command {cmd!r}"})
        except Exception as e:
            reply({"ok": False, "error": f"{e.__class__.__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="one side of megabench's in-run A/B gate (started by the controller)")
    ap.add_argument("--root", required=True, type=Path)
    ap.add_argument("--backend", choices=("pytest", "synthetic"), default="pytest")
    ap.add_argument("--spec", type=Path, default=None, help="synthetic backend: the cases (JSON)")
    ap.add_argument("--name", default="", help="this worker's name (the controller's: side and replica)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    # the channel: a private copy of stdout; fd 1 (print, pytest, C libraries) goes to stderr
    chan_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [str(root)] + [p for p in sys.path if p not in ("", here, str(root))]
    os.chdir(root)
    try:
        spec = json.loads(args.spec.read_text()) if args.spec else {}
        if spec.get("fail_start"):
            raise RuntimeError(str(spec["fail_start"]))
        hello = _import_tree(root)
        if args.backend == "synthetic":
            hello["device"] = spec.get("device")
            hello["arch"] = spec.get("arch", hello.get("arch"))
        hello.update(protocol=PROTOCOL, backend=args.backend, pid=os.getpid())
        backend = SyntheticBackend(spec, args.name) if args.backend == "synthetic" else PytestBackend(root)
    except BaseException as e:  # the tree does not build: say why, then stop
        chan_out.write(json.dumps({"ok": False, "error": f"{e.__class__.__name__}: {e}",
                                   "traceback": traceback.format_exc()[-4000:]}) + "\n")
        chan_out.flush()
        return 3
    chan_out.write(json.dumps({"ok": True, "hello": hello}) + "\n")
    chan_out.flush()
    _serve(backend, chan_out, sys.stdin)
    chan_out.flush()
    # like `megabench`'s leave(): no interpreter teardown of CUDA graphs, modules and allocators
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
