"""Numbers with units, the way an engineer reads them (1.27 us, 4.28 TB/s, 60 MiB, 73.9%), and the
markdown the report and the result notes are written in (escaped cells, wrapped prose, footnotes,
tables within MAX_LINE)."""
from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence


def _sig(v: float, digits: int = 4) -> str:
    return f"{v:.{digits}g}"


def fmt(v, unit: str = "", digits: int = 4) -> str:
    """Format a value in its unit; None/NaN -> an empty cell."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    try:
        v = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    u = (unit or "").strip()
    if u in ("s", "ns", "us", "ms"):
        s = v * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[u]
        a = abs(s)
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
            if a >= scale or name == "ns":
                return f"{_sig(s / scale, digits)} {name}"
    if u == "B":
        a = abs(v)
        if a >= 1e6 and v % 1e6 == 0 and v % 1024:  # a decimal figure (the study's "23 MB"): keep it decimal
            return f"{_sig(v / 1e6, digits)} MB"
        for scale, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if a >= scale:
                return f"{_sig(v / scale, digits)} {name}"
        return f"{int(v) if v == int(v) else _sig(v, digits)} B"
    if u.endswith("/s") and u not in ("tok/s",):
        base = u[:-2]
        a = abs(v)
        for scale, pre in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if a >= scale:
                return f"{_sig(v / scale, digits)} {pre}{base}/s"
        return f"{_sig(v, digits)} {u}"
    if u == "Hz":
        return f"{_sig(v / 1e6, digits)} MHz" if abs(v) >= 1e6 else f"{_sig(v, digits)} Hz"
    if u == "MHz":
        return f"{v:.0f} MHz"
    if u == "fraction":
        return f"{v:.1%}"
    if u == "x":
        return f"{_sig(v, 3)}x"
    if u == "":
        return str(int(v)) if v == int(v) and abs(v) < 1e15 else _sig(v, digits)
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,} {u}"
    return f"{_sig(v, digits)} {u}"


def fmt_range(lo, hi, unit: str = "") -> str:
    a, b = fmt(lo, unit), fmt(hi, unit)
    ua, ub = a.rsplit(" ", 1), b.rsplit(" ", 1)
    if len(ua) == 2 and len(ub) == 2 and ua[1] == ub[1]:
        return f"{ua[0]}-{ub[0]} {ua[1]}"
    return f"{a} - {b}"


def fmt_spread(spread, unit: str) -> str:
    if not spread:
        return ""
    return fmt_range(spread[0], spread[1], unit)


def fmt_params(params) -> str:
    return ", ".join(f"{k}={fmt(v, 'B') if k.endswith('bytes') and isinstance(v, (int, float)) else v}"
                     for k, v in params.items())


def md_escape(s: str) -> str:
    """Keep table cells intact: pipes and newlines would break a GitHub table row."""
    return str(s).replace("|", "\\|").replace("\n", " ")


WRAP = 160  # prose lines of the report are wrapped here (markdown joins them); tables cannot wrap
MAX_LINE = 300  # the summary, class and megakernel sections keep every line within this


def wrap(text: str, first: str = "", rest: str = "", width: int = WRAP) -> list[str]:
    """`text` as lines of at most `width` characters (a single word longer than that stays whole)."""
    return textwrap.wrap(str(text), width=width, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


class Footnotes:
    """Numbered notes of one section: a table cell carries `[n]`, the text is written once below the
    table, so a rule shared by many rows is neither repeated nor allowed to widen every row."""

    def __init__(self, title: str = "Rules and notes"):
        self.title = title
        self.texts: list[str] = []

    def ref(self, text: str | None) -> str:
        if not text:
            return ""
        text = str(text).strip()
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def cell(self, text: str | None, inline_max: int = 60) -> str:
        """Short text stays in the cell; longer text becomes a note."""
        if not text:
            return ""
        return str(text) if len(str(text)) <= inline_max else self.ref(text)

    def lines(self) -> list[str]:
        if not self.texts:
            return []
        out = [f"{self.title}:", ""]
        for i, t in enumerate(self.texts):
            out += wrap(md_escape(t), first=f"- [{i + 1}] ", rest="  ")
        return out + [""]


def fmt_fraction(series) -> str:
    """A series' fraction of its bound: never negative, and flagged when above 100% (the stated
    bound is then not a bound of that quantity). Results recorded before Series.from_samples
    refused them still carry such fractions."""
    f = series.fraction_of_bound
    if f is None:
        return ""
    if series.summary.median <= 0 or f < 0:
        return "n/a (median <= 0: below the timer's resolution)"
    if f > 1.01:
        return f"{f:.1%} (!) bound beaten: not a bound of this quantity"
    return f"{f:.1%}"


def md_table(rows: Sequence[dict]) -> str:
    """A GitHub table (pandas + tabulate, padded); one whose padded lines would exceed MAX_LINE is
    written unpadded instead (same table once rendered)."""
    import pandas as pd  # heavy: pandas, only where a table is rendered

    if not rows:
        return ""
    cells = [{k: md_escape(v) if isinstance(v, str) else v for k, v in r.items()} for r in rows]
    text = pd.DataFrame(cells).to_markdown(index=False, tablefmt="github")
    if max(len(line) for line in text.splitlines()) <= MAX_LINE:
        return text
    cols = list(dict.fromkeys(k for r in cells for k in r))
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in cells]
    return "\n".join(out)
