"""`megabench gate`: the performance-regression gate, and the deterministic kernel-metrics gate.

Three ways to gate timings, best first:

1. In-run A/B (`megabench gate --ab REV`, microbench/gate_ab.py): the baseline revision and the
   working tree are built and timed interleaved in one run on the GPU, judged on paired round
   ratios. The mode CI should use: it sees through run-to-run drift, because both builds share it.
2. Stored results (`megabench gate BASELINE CANDIDATE`, microbench/gate.py): each side is a megabench
   result file, a pytest-benchmark JSON (per-round data kept: `--benchmark-json`, or
   `--benchmark-save` with `--benchmark-save-data`) or a folder of them. A file is one named run;
   a folder means the newest run of each benchmark in it (the newest result file of a benchmark,
   the newest pytest-benchmark file holding a case). Earlier runs in a folder are history, never
   noise: a folder's runs span a changing code base.
3. pytest-benchmark's own `--benchmark-compare-fail` against the committed storage layout
   (reports/benchmarks/<machine_id>/, microbench/bench_storage.py).

Below: the stored rule (microbench/gate.py) with the exit codes, then the kernel-metrics gate
(microbench/kernel_gate.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from microbench import atomic
from microbench import gate as stored
from microbench import kernel_gate as km
from microbench.gate import (EXIT_GPU, EXIT_INPUT, EXIT_UNKNOWN, GateConfig, GpuMismatchError, compare, load_cross_run,
                             load_measurements)
from microbench.gate_ab import ABConfig, cmd_ab, print_report, synthetic_specs
from microbench.gate_quality import ROUNDS, quality_run, run_analysis
from microbench.kernel_gate import KernelThresholds, kernel_gate

DESCRIPTION = "\n".join((__doc__, stored.__doc__, km.__doc__))


def add_parser(sub) -> None:
    s = sub.add_parser("gate", help="performance-regression gate (timing and kernel metrics)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("baseline", nargs="?", type=Path, help="baseline: result file, pytest-benchmark JSON or folder")
    s.add_argument("candidate", nargs="?", type=Path, help="candidate: result file, pytest-benchmark JSON or folder")
    s.add_argument("--floor", type=float, default=GateConfig.floor, help="minimum slowdown that can count (default 0.05)")
    s.add_argument("--k", type=float, default=GateConfig.k, help="noise multiple the slowdown must exceed (default 1)")
    s.add_argument("--alpha", type=float, default=GateConfig.alpha, help="Mann-Whitney significance level (default 0.01)")
    s.add_argument("--min-samples", type=int, default=GateConfig.min_samples, help="raw samples needed a side (default 8)")
    s.add_argument("--allow-unknown", action="store_true", help="unknown verdicts do not fail the gate")
    s.add_argument("--aa-spread", default=None, metavar="PATH|none",
                   help="recorded A/A cross-run spreads (a gate.aa_spread result or a results folder; default: the "
                        "newest for the GPU under the results root and reports/results; 'none': within-run noise only)")
    s.add_argument("--assume-gpu", default=None, metavar="KEY",
                   help="GPU key for pytest-benchmark files that do not record one, e.g. 'NVIDIA H200@1980MHz'")
    s.add_argument("--gpu", default=None, metavar="KEY",
                   help="gate only this GPU's measurements, 'MODEL@CLOCKMHz' or 'MODEL' (a results folder holding "
                        "several GPUs' runs: one GPU at a time)")
    s.add_argument("--markdown", type=Path, default=None, help="also write the verdict table here (job summary)")
    s.add_argument("--json", type=Path, default=None, help="also write the verdicts as JSON here")
    s.add_argument("--kernels", action="store_true", help="gate deterministic kernel metrics instead (CPU)")
    s.add_argument("--update", action="store_true", help="with --kernels: rewrite the baseline file")
    s.add_argument("--kernel-baseline", type=Path, default=None, help="default reports/kernel_metrics.json")
    s.add_argument("--tracked-only", action="store_true", help="with --kernels: only .cu files git tracks")
    s.add_argument("--source", action="append", default=None, metavar="PATH.cu",
                   help="with --kernels: check only this source (repeatable; repository-relative path)")
    s.add_argument("--max-spill-increase", type=int, default=KernelThresholds.max_spill_increase)
    s.add_argument("--max-reg-increase", type=int, default=KernelThresholds.max_reg_increase)
    s.add_argument("--max-smem-increase", type=int, default=KernelThresholds.max_smem_increase)
    s.add_argument("--max-code-increase", type=float, default=KernelThresholds.max_code_increase_pct, metavar="PCT")
    s.add_argument("--quality", nargs="*", default=None, metavar="RUN",
                   help="the gate's measured quality from two or more gate.quality_run results (files or folders; "
                        "default reports/results/gate): gate.quality and gate.aa_spread (microbench/gate_quality.py)")
    s.add_argument("--quality-run", action="store_true",
                   help="GPU: the measurement behind --quality, one in-run A/B session with injected slowdowns "
                        "(~3 minutes on an H200); writes gate.quality_run under --out DIR")
    s.add_argument("--results", type=Path, default=None, help="with --quality --save: results root to save into")
    s.add_argument("--save", action="store_true", help="with --quality: save gate.quality and gate.aa_spread")
    g = s.add_argument_group("in-run A/B (the gate's main mode; microbench/gate_ab.py)")
    g.add_argument("--ab", metavar="REV", default=None,
                   help="baseline git revision: checked out in a temporary worktree and timed against the working "
                        "tree in alternating rounds on this GPU")
    g.add_argument("--ab-tree", metavar="PATH", default=None, help="baseline tree (instead of --ab REV)")
    g.add_argument("--candidate-tree", metavar="PATH", default=None, help="candidate tree (default: this working tree)")
    g.add_argument("--classes", action="append", default=None, metavar="C[,C...]",
                   help="benchmark classes to time (tests/bench/test_bench_<class>.py; repeatable; default: all but "
                        "the torch baselines, without shard8 points: gate_ab.DEFAULT_SELECTION)")
    g.add_argument("-k", dest="select_k", default=None, metavar="EXPR", help="pytest -k expression choosing cases")
    g.add_argument("--marker", default=None, metavar="EXPR", help="pytest -m expression choosing cases")
    g.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 10; --quality-run gate_quality.ROUNDS)")
    g.add_argument("--min-rounds", type=int, default=8, help="rounds needed for a verdict (default 8)")
    g.add_argument("--ab-floor", type=float, default=0.03, help="smallest slowdown an A/B calls a regression (0.03)")
    g.add_argument("--replicas", type=int, default=3, metavar="R",
                   help="worker processes a side (default 3): the process-level test's units; 1 tests rounds only")
    g.add_argument("--backend", default="pytest", metavar="pytest|synthetic:SPEC.json",
                   help="what the workers time: the trees' pytest-benchmark cases, or synthetic cases (CPU tests)")
    g.add_argument("--out", type=Path, default=None,
                   help="with --ab: save the gate.ab result (and markdown) here; with --quality-run: required")
    g.add_argument("--inject-ppm", type=int, default=0, metavar="PPM",
                   help="candidate built with the gate's calibrated slowdown (MB_INJECT_PPM, mb/inject.cuh: 50000 = "
                        "each hooked launch 5%% longer): an A/B that must find a regression")
    s.set_defaults(fn=_cmd)


def _cmd(args) -> int:
    cfg = GateConfig(args.floor, args.k, args.alpha, args.min_samples)
    if args.kernels:
        th = KernelThresholds(args.max_spill_increase, args.max_reg_increase, args.max_smem_increase,
                              args.max_code_increase)
        return kernel_gate(args.update, args.kernel_baseline, th, args.tracked_only, only=args.source)
    if args.ab or args.ab_tree:
        if args.baseline is not None or args.candidate is not None:
            print("megabench gate: --ab/--ab-tree compare trees; do not also give BASELINE CANDIDATE files",
                  file=sys.stderr)
            return EXIT_INPUT
        return cmd_ab(args)
    if args.quality_run:
        return cmd_quality_run(args)
    if args.quality is not None:
        return cmd_quality(args)
    if args.baseline is None or args.candidate is None:
        print("megabench gate: give BASELINE and CANDIDATE (or --kernels / --quality)", file=sys.stderr)
        return EXIT_INPUT
    atomic.check_writable(args.markdown, args.json)  # before the work: a typo'd folder writes neither
    ignored: list[str] = []
    base = load_measurements(args.baseline, args.assume_gpu, ignored, cfg.min_samples)
    cand = load_measurements(args.candidate, args.assume_gpu, ignored, cfg.min_samples)
    if args.gpu is not None:
        def mine(m) -> bool:
            return m.gpu_key is not None and args.gpu in (m.gpu_key, m.gpu_key.split("@", 1)[0])

        have = sorted({m.gpu_key for m in [*base, *cand] if m.gpu_key})
        base, cand = [m for m in base if mine(m)], [m for m in cand if mine(m)]
        if not cand:
            print(f"megabench gate: --gpu {args.gpu!r}: the candidate has no measurements of it; it has {have}",
                  file=sys.stderr)
            return EXIT_INPUT
    cross = None
    if str(args.aa_spread) != "none":
        models = sorted({(m.gpu_key or "").split("@", 1)[0] for m in cand if m.gpu_key})
        cross = load_cross_run(args.aa_spread, models[0] if len(models) == 1 else None)
        if cross is None and args.aa_spread is not None:
            print(f"megabench gate: no gate.aa_spread result for {models} in {args.aa_spread}", file=sys.stderr)
            return EXIT_INPUT
    try:
        rep = compare(base, cand, cfg, cross)
    except GpuMismatchError as e:
        print(f"megabench gate: {e}", file=sys.stderr)
        return EXIT_GPU
    if ignored:
        rep.notes.append(f"ignored {len(ignored)} JSON file(s) that are not performance results "
                         "(gate analyses, constants, other JSON)")
    print_report(rep, args.markdown, args.json)
    code = rep.exit_code(args.allow_unknown)
    if code == EXIT_UNKNOWN:
        print("gate: some verdicts are unknown (no raw samples or too few); not a pass. Use --allow-unknown to "
              "accept that.", file=sys.stderr)
    return code


def cmd_quality_run(args) -> int:
    if args.replicas < 1:
        print(f"megabench gate: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
        return 2
    cfg = ABConfig(floor=args.ab_floor, alpha=args.alpha, min_rounds=args.min_rounds, replicas=args.replicas)
    backend, spec = "pytest", None
    if args.backend and args.backend != "pytest":
        kind, _, sp = args.backend.partition(":")
        if kind != "synthetic" or not sp:
            print(f"megabench gate: --backend {args.backend!r}: 'pytest' or 'synthetic:SPEC.json'", file=sys.stderr)
            return 2
        backend = "synthetic"
        spec = synthetic_specs(Path(sp))[0]
    if args.out is None:
        print("megabench gate --quality-run: give --out DIR", file=sys.stderr)
        return 2
    from megakernel.precompile import quality_build  # heavy: torch (megakernel.plan)

    # the megakernel cases of QUALITY_CASES build small at T=16 and T=1 (tests/bench/test_bench_megakernel.py)
    builds = [(quality_build, ("small", t)) for t in (16, 1)] if backend == "pytest" else []
    quality_run(args.out, args.rounds or ROUNDS, cfg, backend, spec, builds=builds)
    return 0


def cmd_quality(args) -> int:
    q, aa, text = run_analysis(args.quality or None, save=args.save, save_root=args.results)
    print(text)
    return 0
