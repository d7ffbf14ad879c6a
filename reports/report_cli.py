"""`megabench report` (alias `python -m reports`): render REPORT.md and figures from results on disk.

Atomic: the report renders into a temporary folder beside the destination and replaces REPORT.md
and figures/ only when every input parsed; a missing or malformed input exits 2 with its path and
leaves every existing file as it was. `--readme-table` prints the README's headline block (the
shard8 rows of the summary and the class rows), `--update-readme` rewrites that block in place.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from microbench.errors import MegabenchError, ResultsFileError

from .build import build, readme_block
from .summary import replace_block


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
    g = s.add_mutually_exclusive_group()
    g.add_argument("--readme-table", action="store_true",
                   help="print the README's headline block (markdown) instead of writing the report")
    g.add_argument("--update-readme", nargs="?", const=Path("README.md"), type=Path, default=None, metavar="README",
                   help="rewrite the headline block between its markers in README (default README.md)")


def _cmd(args) -> int:
    if args.readme_table:
        print(readme_block(args.results, args.gpu), end="")
        return 0
    if args.update_readme is not None:
        p = args.update_readme
        try:
            old = p.read_text()
        except OSError as e:
            raise ResultsFileError(f"{p}: cannot read ({e.strerror})") from None
        new = replace_block(old, readme_block(args.results, args.gpu), str(p))
        if new != old:
            fd, tmp = tempfile.mkstemp(dir=p.resolve().parent, prefix=".readme-")
            with os.fdopen(fd, "w") as f:
                f.write(new)
            os.replace(tmp, p)
        print(f"{p}: headline block {'updated' if new != old else 'already current'}")
        return 0
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
    except MegabenchError as e:
        print(f"python -m reports: {e}", file=sys.stderr)
        return 2
