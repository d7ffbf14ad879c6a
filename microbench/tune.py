"""`megabench tune`: collect the tuned constants from the latest results into one versioned file.

For every `ConstantSpec` in microbench/constants.py, read the latest result of its benchmark on
one GPU model (`microbench.results.latest`) and take `Result.derived[spec.derived_key]`. Each value
keeps its provenance (benchmark, result file, date, GPU, git sha, the benchmark's rule, its spread)
and `source: "measured"`. A constant whose benchmark has not reported falls back to the spec's
documented conservative default with `source: "default"` and the reason, and the file lists
every such constant at its top (`defaults_used`, `WARNING`).

Near-ties are the benchmark's business: its `Derived.rule` states how it chose (e.g. "smallest
ring within the noise of the best"); tune copies that text, never re-decides from the last digit.

Bad input is refused before anything is written, naming it: a results folder that does not exist,
a result file that does not parse (a truncated newest file is not passed over), a `--gpu` no result
has (the GPUs the results have are named; `--new-gpu` accepts a GPU with no results yet). Every
file is written atomically (microbench/atomic.py), the new revision validated as load_constants
would read it first.

Files (JSON, human-diffable, key order fixed):
  reports/constants/<gpu-slug>.json                 "current": what the megakernel build reads
  reports/constants/history/<gpu-slug>-r<NNNN>.json one file per revision, never overwritten
Writing a new revision never loses anything: the old current content lives on in its revision
file. A current file that differs from its recorded revision (edited by hand) is not replaced
without `--force`. Identical constants and provenance do not create a new revision.

`load_constants(path=None, gpu=None) -> TunedConstants` validates a constants file against SPECS
(schema, format version, names, units, integrality, provenance) and raises ResultsFileError
naming the file and the problem. TunedConstants is a frozen dataclass generated from SPECS.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import difflib
import json
import math
import os
import re
import types
from collections.abc import Mapping
from pathlib import Path

from . import atomic, rederive
from .constants import BY_NAME, SPECS, ConstantSpec, constants_dir, gpu_slug
from .errors import OutputError, ResultsFileError
from .pins import load_pins, pinned_entries
from .results import REPO_ROOT, Result, find, git_sha, load, read_json, results_root, scan

SCHEMA = "megabench.constants"
VERSION = 1
DEFAULT_RULE = "documented conservative default (microbench/constants.py): keeps the megakernel correct, not fast"
PROVENANCE_KEYS = ("benchmark", "derived_key", "result_file", "date", "gpu", "gpu_key", "git_sha", "rule", "spread")


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    try:
        return str(p.relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------- collecting
@dataclasses.dataclass(frozen=True)
class Entry:
    """One constant as tune resolved it."""

    spec: ConstantSpec
    value: float | int
    source: str  # "measured" | "default"
    provenance: Mapping[str, object]

    def to_json(self) -> dict:
        return {"value": self.value, "unit": self.spec.unit, "source": self.source, "doc": self.spec.doc,
                **self.provenance}


def default_gpu(root: Path | None = None) -> str | None:
    """GPU model of the newest result among the constants' benchmarks, else of the newest result
    of any benchmark (a GPU whose classes have not reported still gets its all-defaults file)."""
    own = {s.benchmark for s in SPECS}
    best = {True: ("", None), False: ("", None)}
    for p in find(None, root):
        try:
            d = read_json(p)
        except Exception:
            continue  # a malformed file is reported when tune loads it, not here
        env = d.get("env") or {}
        bench = str(d.get("benchmark", ""))
        if not env.get("gpu") or bench.startswith("gate."):
            continue
        k = bench in own
        if env.get("date", "") > best[k][0]:
            best[k] = (env["date"], env["gpu"])
    return best[True][1] or best[False][1]


def _as_value(spec: ConstantSpec, v: float, where: str) -> tuple[float | int, str]:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ResultsFileError(f"{where}: value {v!r} of {spec.name} is not a finite number")
    if spec.integer:
        r = int(round(v))
        note = "" if abs(r - v) <= 1e-9 * max(1.0, abs(v)) else f"rounded from {v!r} (integer constant)"
        return r, note
    return float(v), ""


def collect(root: Path | None = None, gpu: str | None = None,
            pins: Mapping | None = None) -> tuple[str | None, dict[str, Entry]]:
    """Resolve every constant for `gpu` (default: the newest result's GPU) from results under `root`.

    Each value is the latest result's, re-derived with the current rule from its recorded samples
    where the rule changed since (microbench/rederive.py; the provenance says so). `pins`
    ({name: adopt.Pin}, tune passes the constants folder's pins file) hold a constant at its
    pinned value, with the reason and what the result measured beside it.

    Raises ResultsFileError for a malformed result file, a unit that disagrees with the spec, a
    non-finite value or a rule-less derivation: those are bugs to fix, not gaps to paper over.
    """
    root = Path(root) if root else results_root()
    gpu = gpu or default_gpu(root)
    cache: dict[str, tuple[Result | None, Path | None, dict, set]] = {}
    out: dict[str, Entry] = {}
    for spec in SPECS:
        if spec.benchmark not in cache:
            files = find(spec.benchmark, root, gpu) if gpu else []
            res0 = load(files[-1]) if files else None
            cache[spec.benchmark] = ((res0, files[-1], rederive.derived(res0), rederive.rederived_keys(res0))
                                     if res0 is not None else (None, None, {}, set()))
        res, path, derived, redone = cache[spec.benchmark]
        if res is not None and spec.derived_key in derived:
            d = derived[spec.derived_key]
            where = f"{path} (derived {spec.derived_key!r})"
            if d.unit != spec.unit:
                raise ResultsFileError(f"{where}: unit {d.unit!r} but constant {spec.name} is in {spec.unit!r} "
                                       "(microbench/constants.py); the benchmark must publish it in that unit")
            if not d.rule.strip():
                raise ResultsFileError(f"{where}: no rule stated; a tuned constant must say how it was chosen")
            value, note = _as_value(spec, d.value, where)
            prov = {"benchmark": spec.benchmark, "derived_key": spec.derived_key, "result_file": _rel(path),
                    "date": res.env.date, "gpu": res.env.gpu, "gpu_key": res.env.gpu_key,
                    "git_sha": res.env.git_sha, "git_dirty": res.env.git_dirty, "quick": res.quick,
                    "rule": d.rule, "spread": list(d.spread) if d.spread else None, "inputs": list(d.inputs),
                    "note": "; ".join(x for x in (d.note, note) if x)}
            if spec.derived_key in redone:
                was = res.derived.get(spec.derived_key)
                prov["rederived"] = (f"re-derived with the current rule from the samples recorded in {_rel(path)}"
                                     + (f" (the file records {was.value!r})" if was is not None else
                                        " (the file predates the key)"))
            out[spec.name] = Entry(spec, value, "measured", prov)
        else:
            if res is None:
                why = f"no {spec.benchmark} result" + (f" for {gpu}" if gpu else "") + f" under {_rel(root)}"
            else:
                why = (f"{_rel(path)} has no derived {spec.derived_key!r} "
                       f"(it has: {', '.join(sorted(res.derived)) or 'none'})")
            value, _ = _as_value(spec, spec.default, "microbench/constants.py")
            prov = {"benchmark": spec.benchmark, "derived_key": spec.derived_key, "result_file": None,
                    "date": None, "gpu": None, "gpu_key": None, "git_sha": None, "rule": DEFAULT_RULE,
                    "spread": None, "reason": why}
            out[spec.name] = Entry(spec, value, "default", prov)
    if pins:
        for name, (value, prov) in pinned_entries(gpu, out, pins=pins).items():
            out[name] = Entry(BY_NAME[name], value, "pinned", prov)
    return gpu, out


def render(gpu: str | None, entries: Mapping[str, Entry], root: Path | None = None) -> dict:
    """The constants document (without revision bookkeeping)."""
    defaults = [n for n, e in entries.items() if e.source == "default"]
    pinned = [n for n, e in entries.items() if e.source == "pinned"]
    keys = sorted({e.provenance.get("gpu_key") for e in entries.values() if e.provenance.get("gpu_key")})
    doc = {"schema": SCHEMA, "version": VERSION}
    if defaults:
        doc["WARNING"] = (f"{len(defaults)} of {len(entries)} constants are conservative DEFAULTS, not measured: "
                          + ", ".join(defaults) + ". Run their benchmarks (megabench run) and tune again.")
    if pinned:
        doc["pinned"] = pinned
    doc.update({
        "defaults_used": defaults,
        "gpu": gpu,
        "gpu_key": keys[0] if len(keys) == 1 else (keys or None),
        "results_root": _rel(Path(root) if root else results_root()),
        "constants": {n: e.to_json() for n, e in entries.items()},
    })
    return doc


def _comparable(doc: dict) -> dict:
    """The part of a document that decides whether a new revision is needed."""
    return {k: v for k, v in doc.items() if k not in ("revision", "generated", "generated_by", "supersedes",
                                                      "revision_file", "results_root")}


def write(doc: dict, out_dir: Path | None = None, force: bool = False) -> tuple[Path, Path, bool]:
    """Write `doc` as a new revision and make it current. Returns (current, revision file, created).

    Never overwrites a revision file; refuses to replace a current file that differs from its own
    revision file (hand-edited) unless `force`.
    """
    out_dir = Path(out_dir) if out_dir else constants_dir()
    hist = out_dir / "history"
    slug = gpu_slug(doc.get("gpu"))
    current = out_dir / f"{slug}.json"
    revs = sorted(int(m.group(1)) for p in hist.glob(f"{slug}-r*.json")
                  if (m := re.fullmatch(re.escape(slug) + r"-r(\d+)\.json", p.name)))
    prev = None
    if current.exists():
        try:
            prev = json.loads(current.read_text())
        except json.JSONDecodeError as e:
            if not force:
                raise ResultsFileError(f"{current}: not valid JSON ({e}); refusing to replace it (use --force)") from None
        if prev is not None and not isinstance(prev, dict):
            if not force:
                raise ResultsFileError(f"{current}: not a constants document; refusing to replace it (use --force)")
            prev = None
        if prev is not None:
            rf = prev.get("revision_file")
            recorded = (out_dir / rf) if rf else None
            if not force:
                if recorded is None or not recorded.exists():
                    raise ResultsFileError(f"{current} has no revision file on record (expected "
                                           f"{recorded or 'a revision_file field'}); refusing to replace it "
                                           "without --force")
                if json.loads(recorded.read_text()) != prev:
                    raise ResultsFileError(f"{current} differs from its revision file {recorded} (edited by hand?); "
                                           "refusing to replace it without --force")
            if _comparable(prev) == _comparable(doc) and recorded is not None and recorded.exists():
                return current, recorded, False
    rev = (revs[-1] + 1) if revs else 1
    rev_path = hist / f"{slug}-r{rev:04d}.json"
    full = {**{k: doc[k] for k in ("schema", "version", "WARNING") if k in doc}, "revision": rev,
            "revision_file": str(rev_path.relative_to(out_dir)),
            "supersedes": prev.get("revision_file") if isinstance(prev, dict) else None,
            "generated": _now(), "generated_by": _git_sha(),
            **{k: v for k, v in doc.items() if k not in ("schema", "version", "WARNING")}}
    from_document(full, source=f"the new revision {rev_path}")  # what the build would read: refused before writing
    data = (json.dumps(full, indent=1) + "\n").encode()
    try:
        atomic.write_bytes(rev_path, data, replace=False, mkdir=True)  # a revision is never overwritten
    except OutputError:
        raise ResultsFileError(f"{rev_path} appeared while writing (another tune running?); try again") from None
    # the current pointer is a separate copy (a hard link would let an edit of one change both);
    # its previous content is kept in its own revision file
    atomic.write_bytes(current, data, mkdir=True)
    return current, rev_path, True


def _git_sha() -> str:
    return git_sha()


def _keep_current(gpu: str, entries: dict[str, Entry], only, out_dir: Path | None) -> dict[str, Entry]:
    """Every constant not named in `only` as the current file has it (re-tuning one constant must
    not adopt whatever newer results the other classes left behind); a constant the current file
    lacks (new in microbench/constants.py) is collected too."""
    unknown = sorted(set(only) - set(BY_NAME))
    if unknown:
        raise ResultsFileError(f"tune --only: unknown constants {unknown} (microbench/constants.py has "
                               f"{', '.join(BY_NAME)})")
    cur = (Path(out_dir) if out_dir else constants_dir()) / f"{gpu_slug(gpu)}.json"
    if not cur.exists():
        raise ResultsFileError(f"tune --only: no current constants file {cur} to keep the others from")
    try:
        doc = json.loads(cur.read_text())
        consts = doc["constants"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ResultsFileError(f"{cur}: not a constants document ({e!r}); tune it whole") from None
    out = {}
    for name, e in entries.items():
        old = consts.get(name)
        if name in only or old is None:
            out[name] = e
            continue
        prov = {k: v for k, v in old.items() if k not in ("value", "unit", "source", "doc")}
        out[name] = Entry(e.spec, old["value"], old["source"], prov)
    return out


def known_gpus(root: Path | None = None) -> list[str]:
    """The GPU models the results under `root` were measured on (gate analyses aside). Refuses a
    missing results folder and any result file that does not parse: a truncated file must stop
    tune before it writes anything, not be passed over as if it were not there."""
    root = Path(root) if root else results_root()
    if not root.is_dir():
        raise ResultsFileError(f"results folder {root} does not exist" if not root.exists()
                               else f"results folder {root} is not a folder")
    return sorted({d["env"]["gpu"] for _, d in scan(root, strict=True)
                   if d["env"].get("gpu") and not str(d.get("benchmark", "")).startswith("gate.")})


def check_gpu(gpu: str | None, root: Path | None = None, new_gpu: bool = False) -> None:
    """Refuse a GPU name the results under `root` do not have (a typo would write a second
    constants file of all defaults), naming the ones they have, unless `new_gpu` asks for a
    constants file for a GPU with no results yet."""
    known = known_gpus(root)
    if gpu is None or gpu in known or new_gpu:
        return
    close = difflib.get_close_matches(gpu, known, n=1, cutoff=0.6)
    raise ResultsFileError(
        f"no results for GPU {gpu!r} under {Path(root) if root else results_root()}: the results there are from "
        + (", ".join(repr(g) for g in known) if known else "no GPU")
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + "; pass --new-gpu to write an all-defaults constants file for a GPU with no results yet")


def _document(root, gpu, out_dir, only, new_gpu: bool = False) -> tuple[str | None, dict]:
    """collect, `only` applied (tune --only), rendered: what tune writes and --dry-run prints.
    Bad input (missing folder, unreadable result, unknown GPU) is refused here, before any write."""
    check_gpu(gpu, root, new_gpu)
    gpu = gpu or default_gpu(Path(root) if root else results_root())
    gpu, entries = collect(root, gpu, pins=load_pins(gpu, out_dir))
    if only and gpu:
        entries = _keep_current(gpu, entries, only, out_dir)
    return gpu, render(gpu, entries, root)


def tune(root: Path | None = None, gpu: str | None = None, out_dir: Path | None = None,
         force: bool = False, only=None, new_gpu: bool = False) -> tuple[dict, Path, Path, bool]:
    """only: re-derive just these constants (and any the current file lacks); the rest keep the
    current file's values and provenance. new_gpu: accept a `gpu` no result under `root` has."""
    gpu, doc = _document(root, gpu, out_dir, only, new_gpu)
    if gpu is None:
        raise ResultsFileError(f"no results with a GPU under {root or results_root()} for any constant's benchmark; "
                               "pass --gpu NAME --new-gpu to write an all-defaults file for that GPU")
    cur, rev, created = write(doc, out_dir, force)
    return doc, cur, rev, created


# ----------------------------------------------------------------------------- loading
def _make_class():
    fields = [(s.name, int if s.integer else float) for s in SPECS]
    fields += [("gpu", str | None, dataclasses.field(default=None)),
               ("revision", int | None, dataclasses.field(default=None)),
               ("path", str | None, dataclasses.field(default=None)),
               ("provenance", Mapping, dataclasses.field(default_factory=lambda: types.MappingProxyType({})))]

    def defaults_used(self) -> tuple[str, ...]:
        """Names whose value is the documented default, not a measurement."""
        return tuple(n for n, p in self.provenance.items() if p.get("source") == "default")

    def values(self) -> dict[str, float | int]:
        return {s.name: getattr(self, s.name) for s in SPECS}

    def as_defines(self, prefix: str = "MB_") -> dict[str, str]:
        """{'MB_RING_STAGES': '4', ...} for compile_cuda(defines=...): integers exact, floats as
        C double literals (round-trip repr)."""
        out = {}
        for s in SPECS:
            v = getattr(self, s.name)
            out[prefix + s.name.upper()] = str(int(v)) if s.integer else repr(float(v))
        return out

    @classmethod
    def defaults(cls):
        """All documented defaults (for a build before anything was tuned; says so in provenance)."""
        prov = {s.name: {"source": "default", "rule": DEFAULT_RULE, "reason": "TunedConstants.defaults()"}
                for s in SPECS}
        return cls(**{s.name: (int(s.default) if s.integer else float(s.default)) for s in SPECS},
                   provenance=types.MappingProxyType(prov))

    ns = {"defaults_used": defaults_used, "values": values, "as_defines": as_defines, "defaults": defaults,
          "__doc__": "Tuned constants (one field per microbench.constants.SPECS entry) plus their provenance."}
    ns["__module__"] = __name__  # make_dataclass has no module= before Python 3.12
    return dataclasses.make_dataclass("TunedConstants", fields, namespace=ns, frozen=True)


TunedConstants = _make_class()


class NoConstantsFileError(ResultsFileError):
    """No constants file for the GPU asked for (or none at all in the folder)."""


DEFAULTS_ENV = "defaults"  # MEGABENCH_CONSTANTS=defaults: build with the documented defaults, on purpose


def _known_constants(d: Path) -> str:
    """'NVIDIA H200 (nvidia-h200.json), ...': the GPUs the current constants files in `d` are for."""
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            g = json.loads(p.read_text()).get("gpu")
        except Exception:
            g = None
        out.append(f"{g} ({p.name})" if g else p.name)
    return ", ".join(out) or "none"


def find_constants_file(gpu: str | None = None, directory: Path | None = None) -> Path:
    """The current constants file of `gpu` (a GPU with none is an error naming the GPUs the folder
    has), else $MEGABENCH_CONSTANTS, else the folder's single file (several: an error naming them)."""
    d = Path(directory) if directory else constants_dir()
    if gpu:
        p = d / f"{gpu_slug(gpu)}.json"
        if not p.exists():
            raise NoConstantsFileError(
                f"no constants file for GPU {gpu!r} ({p}); {d} has constants for: {_known_constants(d)}. Run "
                f"`megabench tune --gpu '{gpu}'` (with --new-gpu if no result has that GPU yet), or set "
                f"MEGABENCH_CONSTANTS={DEFAULTS_ENV} to build with the documented defaults on purpose")
        return p
    env = os.environ.get("MEGABENCH_CONSTANTS")
    if env:
        return Path(env)
    cands = sorted(p for p in d.glob("*.json")) if d.is_dir() else []
    if len(cands) == 1:
        return cands[0]
    if not cands:
        raise NoConstantsFileError(f"no constants file in {d}; run `megabench tune` (or use TunedConstants.defaults())")
    raise ResultsFileError(f"several constants files in {d} (constants for: {_known_constants(d)}): pass gpu= or "
                           "path=, or set MEGABENCH_CONSTANTS to the file to build with")


def load_constants(path: str | Path | None = None, gpu: str | None = None, *,
                   defaults_if_missing: bool = False) -> TunedConstants:
    """Read and validate a constants file. Raises ResultsFileError naming the file and the problem;
    a GPU with no constants file is an error naming the GPUs that have one (NoConstantsFileError),
    unless defaults are asked for explicitly: `defaults_if_missing`, or MEGABENCH_CONSTANTS=defaults
    (then TunedConstants.defaults(), whose provenance says so)."""
    if path is None and os.environ.get("MEGABENCH_CONSTANTS") == DEFAULTS_ENV:
        return TunedConstants.defaults()
    try:
        p = Path(path) if path else find_constants_file(gpu)
    except NoConstantsFileError:
        if defaults_if_missing:
            return TunedConstants.defaults()
        raise
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ResultsFileError(f"{p}: no such constants file") from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{p}: not valid JSON ({e})") from None
    return from_document(doc, source=str(p), gpu=gpu)


def from_document(doc, source: str = "<dict>", gpu: str | None = None) -> TunedConstants:
    def bad(msg):
        return ResultsFileError(f"{source}: {msg}")

    if not isinstance(doc, dict):
        raise bad("top level is not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise bad(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r} (is this a constants file?)")
    v = doc.get("version")
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(f"version is {v!r}, expected an integer")
    if v > VERSION:
        raise bad(f"written by a newer megabench (constants version {v}, this reads up to {VERSION}); upgrade")
    if gpu is not None and doc.get("gpu") != gpu:
        raise bad(f"constants are for {doc.get('gpu')!r}, not {gpu!r}: tuned constants never cross GPU models")
    consts = doc.get("constants")
    if not isinstance(consts, dict):
        raise bad("no 'constants' object")
    unknown = sorted(set(consts) - set(BY_NAME))
    if unknown:
        raise bad(f"unknown constants {unknown} (not in microbench/constants.py; file from another version?)")
    missing = [s.name for s in SPECS if s.name not in consts]
    if missing:
        raise bad(f"missing constants {missing}; regenerate it with `megabench tune`")
    values, prov = {}, {}
    for s in SPECS:
        e = consts[s.name]
        if not isinstance(e, dict):
            raise bad(f"{s.name}: expected an object, got {type(e).__name__}")
        if e.get("unit") != s.unit:
            raise bad(f"{s.name}: unit {e.get('unit')!r}, expected {s.unit!r}")
        val = e.get("value")
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            raise bad(f"{s.name}: value {val!r} is not a finite number")
        if s.integer and val != int(val):
            raise bad(f"{s.name}: value {val!r} must be an integer")
        src = e.get("source")
        if src not in ("measured", "default", "pinned"):
            raise bad(f"{s.name}: source {src!r}, expected 'measured', 'default' or 'pinned'")
        if src == "pinned" and not str(e.get("rule", "")).strip():
            raise bad(f"{s.name}: pinned without a reason (its rule)")
        if src == "measured":
            lacking = [k for k in PROVENANCE_KEYS if k not in e or (e[k] in (None, "") and k != "spread")]
            if lacking:
                raise bad(f"{s.name}: measured value without provenance {lacking}")
            if gpu is None and doc.get("gpu") and e["gpu"] != doc["gpu"]:
                raise bad(f"{s.name}: measured on {e['gpu']!r} but the file is for {doc['gpu']!r}")
        values[s.name] = int(val) if s.integer else float(val)
        prov[s.name] = types.MappingProxyType(dict(e))
    rev = doc.get("revision")
    return TunedConstants(**values, gpu=doc.get("gpu"), revision=rev if isinstance(rev, int) else None,
                          path=source, provenance=types.MappingProxyType(prov))


# ----------------------------------------------------------------------------- CLI
def add_parser(sub) -> None:
    s = sub.add_parser("tune", help="collect tuned constants from the latest results into a versioned file",
                       description=__doc__, formatter_class=_raw())
    s.add_argument("--results", type=Path, default=None, help="results root (default $MEGABENCH_RESULTS or reports/results)")
    s.add_argument("--gpu", default=None, help="GPU model name as results record it (default: newest result's GPU); "
                   "a name no result has is refused, naming the ones they have")
    s.add_argument("--new-gpu", action="store_true",
                   help="accept a --gpu no result has yet (writes an all-defaults constants file for it)")
    s.add_argument("--out", type=Path, default=None, help="constants folder (default reports/constants)")
    s.add_argument("--force", action="store_true", help="replace a current file that differs from its revision file")
    s.add_argument("--dry-run", action="store_true", help="print the document, write nothing")
    s.add_argument("--only", nargs="+", metavar="CONSTANT", default=None,
                   help="re-derive only these constants (and any new ones); keep the rest from the current file")
    s.set_defaults(fn=_cmd)


def _raw():
    return argparse.RawDescriptionHelpFormatter


def _cmd(args) -> int:
    if args.dry_run:
        print(json.dumps(_document(args.results, args.gpu, args.out, args.only, args.new_gpu)[1], indent=1))
        return 0
    doc, cur, rev, created = tune(args.results, args.gpu, args.out, args.force, only=args.only, new_gpu=args.new_gpu)
    print(summary(doc, cur, rev, created))
    return 0


def summary(doc: dict, cur: Path, rev: Path, created: bool) -> str:
    lines = []
    if doc.get("defaults_used"):
        lines.append(f"WARNING: {doc['WARNING']}")
    lines.append(("wrote " if created else "unchanged: ") + f"{cur} -> {rev.name}")
    for n, e in doc["constants"].items():
        lines.append(f"  {n:32s} {e['value']!r:>16} {e['unit']:4s} {e['source']:8s} "
                     f"{e.get('result_file') or e.get('reason', '')}")
    return "\n".join(lines)
