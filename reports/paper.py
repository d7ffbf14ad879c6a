"""The study's figures as data (reports/paper_figures.json): each number, its setup (the authors'
8 x GB300 system unless stated), the overhead class it belongs to, and how ours is obtained.

The file is package data, the one copy of the study's numbers. `validate()` is what the
tests call: every figure has a value or a range, a known setup and a known class, and every figure
with an "ours" says whether ours is the same quantity under the same conditions (`compare`:
"same", or what differs). reports/study.py turns them into the report's rows.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from microbench.errors import ResultsFileError
from microbench.fmt import fmt, fmt_range

PATH = Path(__file__).with_name("paper_figures.json")
CLASSES = ("icache", "weights", "sync", "clocks", "xgpu", "megakernel", "model")


@functools.lru_cache(maxsize=1)
def load(path: str | None = None) -> dict:
    p = Path(path) if path else PATH
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsFileError(f"{p}: cannot read the study's figures ({e})") from None
    validate(d, str(p))
    return d


def validate(d: dict, source: str = "<paper figures>") -> None:
    if d.get("schema") != "megabench.paper_figures":
        raise ResultsFileError(f"{source}: schema {d.get('schema')!r}, expected 'megabench.paper_figures'")
    setups = d.get("setups") or {}
    ids = set()
    for f in d.get("figures", []):
        fid = f.get("id")
        if not fid or fid in ids:
            raise ResultsFileError(f"{source}: figure id {fid!r} missing or duplicated")
        ids.add(fid)
        if f.get("setup") not in setups:
            raise ResultsFileError(f"{source}: {fid}: unknown setup {f.get('setup')!r}")
        if f.get("class") not in CLASSES:
            raise ResultsFileError(f"{source}: {fid}: unknown class {f.get('class')!r}")
        has_value = isinstance(f.get("value"), (int, float))
        has_range = isinstance(f.get("low"), (int, float)) and isinstance(f.get("high"), (int, float))
        if has_value == has_range:
            raise ResultsFileError(f"{source}: {fid}: needs exactly one of value or low/high")
        ours = f.get("ours")
        if ours is not None and ours.get("kind") not in (d.get("ours_kinds") or {}):
            raise ResultsFileError(f"{source}: {fid}: unknown ours.kind {ours.get('kind')!r}")
        if ours is not None and not str(f.get("compare", "")).strip():
            raise ResultsFileError(f"{source}: {fid}: has an 'ours' but no 'compare': say whether it is the same quantity "
                                   "under the same conditions ('same') or what differs")


def figures(cls: str | None = None, group: str | None = None) -> list[dict]:
    return [f for f in load()["figures"] if (cls is None or f["class"] == cls) and (group is None or f["group"] == group)]


def setup(name: str) -> dict:
    return load()["setups"][name]


def value_text(f: dict) -> str:
    """The study's figure as the report prints it (a range as lo-hi; its setup named unless GB300)."""
    t = fmt(f["value"], f["unit"]) if "value" in f else fmt_range(f["low"], f["high"], f["unit"])
    return t if f["setup"] == "gb300" else f"{t} ({setup(f['setup'])['short']})"
