"""Where a kernel's warps stall, from Nsight Compute's per-instruction stall samples.

Reads the output of `ncu --import X.ncu-rep --page source --csv --print-source sass` (gzip-compressed
when the path ends in .gz): for each kernel a `"Kernel Name","<name>"` line, a header line, then one
row per SASS instruction. Used columns: "Address", "Source", "# Samples", "Instructions Executed" and
every "stall_*" column that is not a "(Not Issued)" one (those count only the not-issued subset of
the same samples); in ncu's output the stall columns of a row add up to its "# Samples".

Grouping by execution count: every instruction of a straight-line stretch of code runs the same
number of times, and instructions of one loop body run (trip count) times as often as the code
around the loop. So instructions with equal "Instructions Executed" belong to the same loop level
of the same code region, and the classes separate e.g. an inner k-loop from per-chunk and per-unit
code without needing the control-flow graph. (Two unrelated regions can share a count by chance;
`hottest` lists addresses to tell them apart.)

A file holding several kernels is refused unless `kernel=` picks one (by name or by position):
summing samples or execution counts over different kernels would mix unrelated loop levels.

By source position (`by_source`): joined instruction by instruction with the same build's
`nvdisasm -gi -c` listing (its inline chains: microbench.sass.instruction_chains), so the samples,
and the instruction-fetch stalls among them, land on the source lines whose code they hit. Every
opcode is compared, so a listing of another build is refused rather than misattributed.
"""
from __future__ import annotations

import csv
import gzip
from collections.abc import Callable
from pathlib import Path

import pandas as pd

BASE = ["kernel", "address", "source", "samples", "executed"]  # every other column is a stall reason
_NEEDED = {"address": "Address", "source": "Source", "samples": "# Samples", "executed": "Instructions Executed"}


def _num(cell: str) -> int:
    """A count cell; ncu leaves empty (or '-') where there is nothing to count."""
    s = cell.strip().replace(",", "")
    return 0 if s in ("", "-") else int(float(s))


def _blocks(path: Path) -> list[dict]:
    """Split the file into kernels: [{name, header, rows}] in file order."""
    opener = gzip.open if path.suffix == ".gz" else open
    blocks: list[dict] = []
    try:
        with opener(path, "rt", newline="") as f:
            for row in csv.reader(f):
                if not row or not any(c.strip() for c in row):
                    continue
                if row[0] == "Kernel Name":
                    blocks.append({"name": row[1] if len(row) > 1 else "", "header": None, "rows": []})
                elif row[0] == "Address" and (not blocks or blocks[-1]["header"] is None):
                    if not blocks:  # a file cut to its table alone: one unnamed kernel
                        blocks.append({"name": "", "header": None, "rows": []})
                    blocks[-1]["header"] = row
                elif blocks and blocks[-1]["header"] is not None:
                    blocks[-1]["rows"].append(row)
    except (OSError, UnicodeDecodeError, csv.Error) as e:  # missing, unreadable or not text/gzip
        raise ValueError(f"{path}: cannot read as an ncu source-page CSV: {e}") from e
    return blocks


def _pick(path: Path, blocks: list[dict], kernel: str | int | None) -> dict:
    names = ", ".join(f"{i}: {b['name']!r}" for i, b in enumerate(blocks))
    if isinstance(kernel, int):
        if not 0 <= kernel < len(blocks):
            raise ValueError(f"{path}: no kernel #{kernel}; the file holds {names}")
        return blocks[kernel]
    if kernel is None:
        if len(blocks) > 1:
            raise ValueError(f"{path}: several kernels and none selected; pass kernel= a name or position: {names}")
        return blocks[0]
    found = [b for b in blocks if b["name"] == kernel]
    if len(found) != 1:  # one name profiled twice (two launches) is ambiguous: pick by position
        why = "no kernel named" if not found else "several kernels named"
        raise ValueError(f"{path}: {why} {kernel!r}; pass kernel= a name or position: {names}")
    return found[0]


def kernels(path) -> list[str]:
    """The kernel names of the file, in file order (one per profiled launch; names may repeat)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    return [b["name"] for b in _blocks(path)]


def read_sass_csv(path, kernel: str | int | None = None) -> pd.DataFrame:
    """One row per SASS instruction of one kernel: kernel, address, source, samples, executed and one
    int column per stall reason (without the `stall_` prefix). Rows too short for the used columns,
    or whose address or counts do not parse, are skipped; their number is in df.attrs["skipped"].
    Raises ValueError (naming the file) for a missing or unreadable file, missing columns, an
    ambiguous or unknown kernel, or no instruction rows."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    blocks = _blocks(path)
    if not blocks or all(b["header"] is None for b in blocks):
        raise ValueError(f"{path}: no header line starting with \"Address\" (not ncu --page source --csv output?)")
    b = _pick(path, blocks, kernel)
    header = b["header"] or []
    missing = [c for c in _NEEDED.values() if c not in header]
    stalls = {c[len("stall_"):]: header.index(c) for c in header
              if c.startswith("stall_") and "(Not Issued)" not in c}
    if not stalls:
        missing.append("stall_* (no stall reason columns)")
    if missing:
        raise ValueError(f"{path}: kernel {b['name']!r} lacks column(s): {', '.join(missing)}")
    idx = {k: header.index(c) for k, c in _NEEDED.items()}
    last = max([*idx.values(), *stalls.values()])
    recs, skipped = [], 0
    for row in b["rows"]:
        try:
            if len(row) <= last:
                raise ValueError("short row")
            rec = {"kernel": b["name"], "address": int(row[idx["address"]].strip(), 16),
                   "source": row[idx["source"]], "samples": _num(row[idx["samples"]]),
                   "executed": _num(row[idx["executed"]])}
            rec.update({r: _num(row[i]) for r, i in stalls.items()})
        except (ValueError, OverflowError):  # bad address, non-numeric count, "inf"
            skipped += 1
            continue
        recs.append(rec)
    if not recs:
        raise ValueError(f"{path}: kernel {b['name']!r} has no readable instruction rows ({skipped} skipped)")
    df = pd.DataFrame.from_records(recs, columns=BASE + list(stalls))
    df.attrs["skipped"] = skipped
    return df


def reasons(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if c not in BASE]


def stall_totals(df: pd.DataFrame) -> pd.DataFrame:
    """reason, samples, fraction (of all stall samples), largest first; reasons never sampled dropped."""
    s = df[reasons(df)].sum()
    t = pd.DataFrame({"reason": s.index, "samples": s.to_numpy(dtype="int64")})
    t = t[t.samples > 0].sort_values(["samples", "reason"], ascending=[False, True], ignore_index=True)
    t["fraction"] = t.samples / max(int(t.samples.sum()), 1)
    return t


def _ranked(counts: pd.Series) -> pd.Series:
    """Non-zero stall counts, largest first; ties by reason name so the output does not depend on column order."""
    return counts[counts > 0].sort_index().sort_values(ascending=False, kind="stable")


def _top3(counts: pd.Series, total: int) -> str:
    """"selected 33%, wait 17%, math 17%": the 3 largest reasons as percent of `total`."""
    return ", ".join(f"{r} {100 * v / total:.0f}%" for r, v in _ranked(counts).head(3).items()) if total else ""


def by_execution_count(df: pd.DataFrame, top: int = 12) -> pd.DataFrame:
    """The `top` execution-count classes with most samples, most first: executed, instructions,
    samples, fraction (of all samples), top3 (largest stall reasons, percent of the class's samples).
    Classes without samples are dropped."""
    rs = reasons(df)
    g = df.groupby("executed")
    c = g[["samples", *rs]].sum()
    c.insert(0, "instructions", g.size())
    c = c[c.samples > 0].reset_index()
    c = c.sort_values(["samples", "executed"], ascending=[False, False], ignore_index=True).head(top)
    c["fraction"] = c.samples / max(int(df.samples.sum()), 1)
    c["top3"] = [_top3(r[rs], int(r.samples)) for _, r in c.iterrows()]
    return c[["executed", "instructions", "samples", "fraction", "top3"]]


def hottest(df: pd.DataFrame, n: int = 20) -> pd.DataFrame:
    """The n instructions with most samples (ties by address): address (hex), source, samples,
    executed, top_stall. Instructions without samples are dropped."""
    h = df[df.samples > 0].sort_values(["samples", "address"], ascending=[False, True]).head(n)
    top = [next(iter(_ranked(r).index), "") for _, r in h[reasons(df)].iterrows()]
    return pd.DataFrame({"address": [f"{a:#x}" for a in h.address], "source": [s.strip() for s in h.source],
                         "samples": h.samples.to_numpy(), "executed": h.executed.to_numpy(), "top_stall": top})


def _opcode(text: str) -> str:
    """The opcode of a SASS instruction text, without its predicate ("@!P0 BRA ..." -> "BRA")."""
    words = text.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def _chain_of(df: pd.DataFrame, chains: list[tuple[int, str, list[str]]]) -> list[list[str]]:
    """The inline chain of every profiled instruction (microbench.sass.instruction_chains of the
    same build; offset = address - the kernel's first address; [] where nvdisasm gave none).
    Raises ValueError when the listing is not the profiled build: an offset missing from the
    listing, or another opcode there."""
    at = {off: (text, chain) for off, text, chain in chains}
    base = int(df.address.min()) if len(df) else 0
    out = []
    for addr, src in zip(df.address, df.source):
        hit = at.get(int(addr) - base)
        if hit is None or _opcode(hit[0]) != _opcode(src):
            got = "nothing" if hit is None else repr(hit[0])
            skipped = df.attrs.get("skipped", 0)  # a skipped first row would shift every offset
            raise ValueError(f"the SASS listing is not the profiled build: offset {int(addr) - base:#x} is "
                             f"{src.strip()!r} in the profile and {got} in the listing"
                             + (f" ({skipped} malformed profile rows were skipped)" if skipped else ""))
        out.append(hit[1])
    return out


def by_source(df: pd.DataFrame, chains: list[tuple[int, str, list[str]]], label: Callable[[list[str]], str],
              top: int = 25) -> pd.DataFrame:
    """Samples per source position: df (read_sass_csv) joined with instruction_chains
    (microbench.sass) of the same build, instruction by instruction, grouped by label(chain) ("?"
    where nvdisasm gave no chain). The `top` groups with most samples: source, instructions (those
    executed at all), executed (warp instructions), samples, no_inst (instruction-fetch stall
    samples; 0 if ncu had no such column), top3. Raises ValueError when the listing is not the
    profiled build (_chain_of)."""
    keys = [label(c) if c else "?" for c in _chain_of(df, chains)]
    rs = reasons(df)
    d = df.assign(source_pos=keys, ran=(df.executed > 0).astype("int64"))
    if "no_inst" not in d.columns:
        d = d.assign(no_inst=0)
    g = d.groupby("source_pos")
    t = g[["ran", "executed", "samples", "no_inst", *[r for r in rs if r != "no_inst"]]].sum()
    t = t[t.samples > 0].reset_index()
    t = t.sort_values(["samples", "source_pos"], ascending=[False, True], ignore_index=True).head(top)
    t["top3"] = [_top3(r[rs], int(r.samples)) for _, r in t.iterrows()]
    return t.rename(columns={"source_pos": "source", "ran": "instructions"})[
        ["source", "instructions", "executed", "samples", "no_inst", "top3"]]


# An instruction of these source files is a bounded wait for a bulk copy (mk/wait.cuh: the ring's
# and the staging's mbarriers): the op waits for its bytes there, it does no work of its own.
COPY_WAIT_SOURCES = ("mk/wait.cuh:",)


def by_op(df: pd.DataFrame, chains: list[tuple[int, str, list[str]]], op: Callable[[list[str]], str]) -> pd.DataFrame:
    """The per-op account: every op's samples split into its copy waits (innermost
    source in COPY_WAIT_SOURCES) and its own work (the rest), and what the own work stalls on.
    Columns: op, instructions (executed at all), executed (warp instructions), samples, share (of
    all samples), copy_wait (samples), own (samples), own_no_inst and own_long_sb (percent of own:
    instruction fetch, and waits on global or L2 loads), own_top3. Largest `samples` first. A
    sample is one warp's state at one sampling instant, so an op's share is its share of the warps'
    resident time, not of the critical path. Raises ValueError as by_source does."""
    cs = _chain_of(df, chains)
    rs = reasons(df)
    d = df.assign(op=[op(c) if c else "?" for c in cs], ran=(df.executed > 0).astype("int64"),
                  waiting=[bool(c) and any(w in c[0] for w in COPY_WAIT_SOURCES) for c in cs])
    for r in ("no_inst", "long_sb"):
        if r not in d.columns:
            d = d.assign(**{r: 0})
    total = max(int(d.samples.sum()), 1)
    rows = []
    for name, g in d.groupby("op"):
        if int(g.samples.sum()) == 0:
            continue  # an op that never ran here (another launch's), as by_source drops it
        own = g[~g.waiting]
        n_own = int(own.samples.sum())
        counts = own[rs].sum()

        def pct(reason: str) -> str:  # percent of the op's own samples ("" when it has none)
            return f"{100 * int(own[reason].sum()) / n_own:.0f}%" if n_own else ""

        rows.append({"op": name, "instructions": int(g.ran.sum()), "executed": int(g.executed.sum()),
                     "samples": int(g.samples.sum()), "share": f"{100 * int(g.samples.sum()) / total:.1f}%",
                     "copy_wait": int(g[g.waiting].samples.sum()), "own": n_own,
                     "own_no_inst": pct("no_inst"), "own_long_sb": pct("long_sb"),
                     "own_top3": _top3(counts, n_own)})
    t = pd.DataFrame(rows, columns=["op", "instructions", "executed", "samples", "share", "copy_wait", "own",
                                    "own_no_inst", "own_long_sb", "own_top3"])
    return t.sort_values(["samples", "op"], ascending=[False, True], ignore_index=True)


def summary_markdown(df: pd.DataFrame, top: int = 12, n: int = 20) -> str:
    """Three markdown tables (totals, execution-count classes, hottest instructions) with headings."""
    def pct(t: pd.DataFrame) -> pd.DataFrame:
        return t.assign(fraction=[f"{100 * f:.1f}%" for f in t.fraction])

    name = df.kernel.iloc[0] if len(df) else ""
    total = int(df.samples.sum())
    skipped = df.attrs.get("skipped", 0)  # said, not silently dropped
    return "\n".join([
        f"## Stall reasons: kernel `{name}`, {total} samples over {len(df)} SASS instructions"
        + (f" ({skipped} malformed rows skipped)" if skipped else ""),
        "", pct(stall_totals(df)).to_markdown(index=False), "",
        f"## Top {top} execution-count classes (same count = same loop level of one code region)",
        "", pct(by_execution_count(df, top)).to_markdown(index=False), "",
        f"## Hottest {n} instructions",
        "", hottest(df, n).to_markdown(index=False), ""])
