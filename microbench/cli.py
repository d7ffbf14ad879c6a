"""`megabench` command line. Subcommands: info, bench (more are registered by later modules)."""
from __future__ import annotations

import argparse
import os
import sys


def _info(args) -> int:
    from .info import describe

    print(describe())
    return 0


def _bench(args) -> int:
    from .device import no_gpu_reason
    from .registry import benchmarks

    reason = no_gpu_reason()
    if reason:
        print(f"megabench bench: no GPU ({reason}); benchmarks need one.", file=sys.stderr)
        return 2
    from .harness import Harness

    h = Harness()
    todo = benchmarks(args.classes or None)
    if args.only:
        todo = {k: v for k, v in todo.items() if any(k.startswith(o) for o in args.only)}
    for name, fn in todo.items():
        print(f"[bench] {name} ...", flush=True)
        res = fn(h, quick=not args.full, save=True)
        for s in res.series:
            frac = f" ({s.fraction_of_bound:.1%} of bound)" if s.fraction_of_bound else ""
            print(f"    {s.name:50s} median {s.summary.median:.4g} {s.unit}{frac}")
        for k, d in res.derived.items():
            print(f"    -> {k} = {d.value:.4g} {d.unit}")
    from .teardown import leave

    leave(0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megabench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("info", help="device, clocks, L2, SMs, driver and compiler versions")
    s.set_defaults(fn=_info)
    s = sub.add_parser("bench", help="run microbenchmarks and save results")
    s.add_argument("classes", nargs="*", help="overhead classes (default: all)")
    s.add_argument("--only", nargs="*", help="benchmark name prefixes")
    s.add_argument("--full", action="store_true", help="full sweeps")
    s.set_defaults(fn=_bench)
    from . import cli_ext

    cli_ext.register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:
        from .errors import MegabenchError

        if isinstance(e, MegabenchError):
            print(f"megabench {args.cmd}: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
