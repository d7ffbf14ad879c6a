"""A class's measured-values note: one markdown table of derived values read from the latest saved
results (never typed in), each with its spread, date and GPU; a missing result is said to be
missing. Each class lists its rows in `<class>/note.py` and calls `render`/`main` from here."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from .results import latest

Row = tuple[str, str, str, float, str]  # (benchmark, derived key, label, scale, unit shown)


def render(title: str, rows: Sequence[Row], root: Path | None = None) -> str:
    lines = [f"# {title}: measured values", "",
             "| quantity | value | spread | measured | GPU |", "|---|---|---|---|---|"]
    cache = {}
    for bench, key, label, scale, unit in rows:
        if bench not in cache:
            cache[bench] = latest(bench, root)
        r = cache[bench]
        d = r.derived.get(key) if r else None
        if d is None:
            lines.append(f"| {label} | not measured{'' if r else ' (no ' + bench + ' result)'} | | | |")
            continue
        sp = f"{d.spread[0] * scale:.4g} .. {d.spread[1] * scale:.4g}" if d.spread else ""
        lines.append(f"| {label} | {d.value * scale:.4g} {unit} | {sp} | {r.env.date[:10]} | {r.env.gpu} |")
    lines += ["", "Rules behind each value are in the result files (`Derived.rule`); notes:"]
    for bench, r in cache.items():
        for n in (r.notes if r else ()):
            lines.append(f"- {bench}: {n}")
    return "\n".join(lines) + "\n"


def main(doc: str, render_fn: Callable[[Path | None], str], argv=None) -> int:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--root", type=Path, default=None, help="results root (default: reports/results)")
    print(render_fn(ap.parse_args(argv).root), end="")
    return 0
