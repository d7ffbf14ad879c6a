"""`megabench`: the one command line of the project (docs/COMMANDS.md: every command, its flags and
exit codes). Exit codes shared by every command: 0 done; 2 bad input (an unknown command, class,
preset or GPU, an unreadable or malformed file), named on stderr; the others are each command's.

The commands live on the floor of what they combine: the harness's (info, tune, adopt, xgpu,
test-run, icache, stability, bench-storage, source-tree) in microbench, the megakernel's tools
under `mk` (and `decode`, speculative decoding on the device, at the top level: megakernel/cli.py),
and here the ones that put both together (bench, run, constants, report, gate, prune-results).
"""
from __future__ import annotations

import argparse
import sys

from megakernel import cli as mk_cli
from microbench import adopt, bench_storage, stability, testrun, tune
from microbench import results as results_mod
from microbench.device import no_gpu_reason
from microbench.errors import MegabenchError
from microbench.harness import Harness
from microbench.icache import precompile as icache_precompile
from microbench.info import describe
from microbench.teardown import leave
from microbench.xgpu import launcher

from . import classes, constants_cli, gate_cli, report_cli, retention, run


def _info(args) -> int:
    print(describe())
    return 0


def _bench(args) -> int:
    try:
        todo = classes.benchmarks(args.classes or None)
    except ValueError as e:
        print(f"megabench bench: {e}", file=sys.stderr)
        return 2
    if args.only:
        todo = {k: v for k, v in todo.items() if any(k.startswith(o) for o in args.only)}
        if not todo:
            print(f"megabench bench: no benchmark starts with {args.only}", file=sys.stderr)
            return 2
    reason = no_gpu_reason()
    if reason:
        print(f"megabench bench: no GPU ({reason}); benchmarks need one.", file=sys.stderr)
        return 2
    h = Harness()
    for name, fn in todo.items():
        print(f"[bench] {name} ...", flush=True)
        res = fn(h, quick=not args.full, save=True)
        for s in res.series:
            frac = f" ({s.fraction_of_bound:.1%} of bound)" if s.fraction_of_bound else ""
            print(f"    {s.name:50s} median {s.summary.median:.4g} {s.unit}{frac}")
        for k, d in res.derived.items():
            print(f"    -> {k} = {d.value:.4g} {d.unit}")
    leave(0)  # every result saved and printed: no interpreter teardown (microbench.teardown)


def _mk(args) -> int:
    return mk_cli.run_tool(args, prog="megabench mk")


def _passthrough(args) -> int:
    return PASSTHROUGH[args.cmd][1](args.args, f"megabench {args.cmd}")


# commands with a parser of their own (their `python -m` form is the alias): name -> (help, main(argv, prog))
PASSTHROUGH = {
    "icache": ("icache tools: `icache precompile [--full]` fills the kernel cache (no GPU)", icache_precompile.main),
    "stability": ("whether each build constant comes out the same on two machines (exit 1: an unpinned flip)",
                  stability.main),
    "bench-storage": ("write a pytest-benchmark baseline into reports/benchmarks/<machine>/", bench_storage.main),
    "source-tree": ("print the id of the sources' tree, for MEGABENCH_SOURCE_TREE on a copy",
                    lambda argv, prog: results_mod._main(["source-tree", *argv])),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megabench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    s = sub.add_parser("info", help="device, clocks, L2, SMs, driver and compiler versions")
    s.set_defaults(fn=_info)
    s = sub.add_parser("bench", help="run microbenchmarks of the named classes and save results (GPU)")
    s.add_argument("classes", nargs="*", help=f"overhead classes (default: all of {', '.join(classes.NAMES)})")
    s.add_argument("--only", nargs="*", help="benchmark name prefixes")
    s.add_argument("--full", action="store_true", help="full sweeps")
    s.set_defaults(fn=_bench)
    run.add_parser(sub)
    tune.add_parser(sub)
    adopt.add_parser(sub)
    constants_cli.add_parser(sub)
    report_cli.add_parser(sub)
    retention.add_parser(sub)
    gate_cli.add_parser(sub)
    launcher.add_parser(sub)
    testrun.add_parser(sub)
    s = sub.add_parser("mk", help="the megakernel's tools: build, check-and-bench, ab, ncu-*, sm-map, ... (`mk --help`)",
                       description=mk_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mk_cli.add_tools(s.add_subparsers(dest="tool", required=True, metavar="TOOL"))
    s.set_defaults(fn=_mk)
    mk_cli.add_decode_parser(sub)
    for name, (what, _) in PASSTHROUGH.items():
        s = sub.add_parser(name, help=what, add_help=False, prefix_chars="\0")  # its own parser reads every argument
        s.add_argument("args", nargs=argparse.REMAINDER)
        s.set_defaults(fn=_passthrough)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MegabenchError as e:
        print(f"megabench {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
