"""`megabench report` / `python -m reports`: render REPORT.md and figures from results on disk."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> None:
    s = sub.add_parser("report", help="render the markdown report (+ PNG figures) from results on disk",
                       description=__doc__)
    _args(s)
    s.set_defaults(fn=_cmd)


def _args(s) -> None:
    s.add_argument("--results", type=Path, default=None,
                   help="results root (default $MEGABENCH_RESULTS or reports/results)")
    s.add_argument("--out", type=Path, default=None, help="output folder for REPORT.md and figures/ (default reports/)")
    s.add_argument("--benchmarks", type=Path, default=None,
                   help="pytest-benchmark JSON folder for the changes table (default reports/benchmarks)")
    s.add_argument("--baseline", type=Path, default=None,
                   help="compare the newest results against this baseline (file or folder) instead of earlier runs")
    s.add_argument("--gpu", default=None, help="GPU model to report (default: the newest result's)")


def _cmd(args) -> int:
    from .build import build

    p = build(args.results, args.out, args.benchmarks, args.baseline, args.gpu)
    figs = sorted((p.parent / "figures").glob("*.png"))
    print(f"wrote {p} and {len(figs)} figure(s) in {p.parent / 'figures'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reports", description=__doc__)
    _args(p)
    args = p.parse_args(argv)
    try:
        return _cmd(args)
    except Exception as e:
        from microbench.errors import MegabenchError

        if isinstance(e, MegabenchError):
            print(f"python -m reports: {e}", file=sys.stderr)
            return 2
        raise
