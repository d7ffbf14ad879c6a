"""Which tuned constants the megakernel build reads: an adopted revision, and pinned constants.

`megabench tune` writes a new constants revision whenever the results move (reports/constants/
<gpu>.json and history/<gpu>-rNNNN.json). The megakernel never builds from whatever tune wrote
last: it reads the revision named by the adoption file

    reports/constants/adopted/<gpu-slug>.json

which changes only through `megabench adopt`, and only with a measurement: the megakernel
results that ran the build with that revision (their env records constants_revision, set by
megakernel/plans.py when it loads constants). So a re-tuned ring or prefetch budget reaches the
build only after the build it changes has been measured: a fresh run's re-tune never reaches the
build unmeasured.

Pins (microbench/pins.py) hold a constant at a stated value in every new revision; tune applies
them. Adoption files are versioned data with their reasons, in a folder below the constants
folder (its top level holds exactly one current file per GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import re
import subprocess
import types
from collections.abc import Sequence
from pathlib import Path

from .atomic import write_text
from .constants import RENAMED, SPECS, gpu_slug
from .errors import ResultsFileError
from .pins import VERSION, folder_of, load_pins, read_document
from .results import REPO_ROOT, load
from .tune import DEFAULT_RULE, from_document

ADOPTION_SCHEMA = "megabench.constants_adoption"


def _write(p: Path, doc: dict) -> None:
    write_text(p, json.dumps(doc, indent=1) + "\n", mkdir=True)


# ----------------------------------------------------------------------------- adoption
def adoption_path(gpu: str | None, directory=None) -> Path:
    return folder_of(directory) / "adopted" / f"{gpu_slug(gpu)}.json"


def load_adoption(gpu: str | None, directory=None) -> dict | None:
    """The adoption record for `gpu`, or None when there is none."""
    p = adoption_path(gpu, directory)
    if not p.exists():
        return None
    d = read_document(p, ADOPTION_SCHEMA)
    for k in ("gpu", "revision", "revision_file", "reason"):
        if d.get(k) in (None, ""):
            raise ResultsFileError(f"{p}: no {k!r}")
    if gpu is not None and d["gpu"] != gpu:
        raise ResultsFileError(f"{p}: adoption for {d['gpu']!r}, not {gpu!r}")
    return d


def has_adoption(gpu: str | None, directory=None) -> bool:
    """Whether an adoption file applies: `gpu`'s, or, without a GPU, the folder's only one (several
    without a GPU to choose: an error naming the problem, as for constants files)."""
    if gpu is not None:
        return adoption_path(gpu, directory).exists()
    folder = folder_of(directory) / "adopted"
    n = len(list(folder.glob("*.json"))) if folder.is_dir() else 0
    if n > 1:
        raise ResultsFileError(f"{folder}: {n} adoption files and no GPU to choose one; pass gpu=")
    return n == 1


def adoptions(directory=None) -> list[dict]:
    """Every adoption record in the constants folder (one per GPU)."""
    folder = folder_of(directory) / "adopted"
    return [read_document(p, ADOPTION_SCHEMA) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def revision_document(gpu: str | None, revision_file: str, directory=None) -> dict:
    """A constants revision's document, written before later renames and additions: old names
    (constants.RENAMED) are mapped to new ones and constants the revision predates are filled
    with their documented default, each saying so in its provenance. Only the adopted build
    reads revisions this way; tune's own loader stays strict."""
    p = folder_of(directory) / revision_file
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ResultsFileError(f"{p}: the adopted constants revision does not exist") from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{p}: not valid JSON ({e})") from None
    consts = dict(doc.get("constants") or {})
    for old, new in RENAMED.items():
        if old in consts and new not in consts:
            e = dict(consts.pop(old))
            e["note"] = "; ".join(x for x in (e.get("note"), f"recorded as {old!r} in this revision (renamed since; "
                                              "measured with the rule of its time)") if x)
            consts[new] = e
    for s in SPECS:
        if s.name not in consts:
            consts[s.name] = {"value": int(s.default) if s.integer else float(s.default), "unit": s.unit,
                              "source": "default", "doc": s.doc, "rule": DEFAULT_RULE,
                              "reason": f"not in {revision_file} (the constant was added after it)"}
    return {**doc, "constants": consts}


def load_adopted(gpu: str | None = None, directory=None):
    """TunedConstants of the adopted revision for `gpu` (the only adoption when gpu is None and
    exactly one exists). Raises ResultsFileError when there is none."""
    if gpu is None:
        recs = adoptions(directory)
        if len(recs) != 1:
            raise ResultsFileError(f"{folder_of(directory) / 'adopted'}: {len(recs)} adoption files; pass gpu=")
        rec = recs[0]
    else:
        rec = load_adoption(gpu, directory)
        if rec is None:
            raise ResultsFileError(f"no adopted constants revision for {gpu} ({adoption_path(gpu, directory)}); "
                                   "adopt one with `megabench adopt` after measuring the build with it")
    doc = revision_document(rec["gpu"], rec["revision_file"], directory)
    src = str(folder_of(directory) / rec["revision_file"])
    c = from_document(doc, source=src, gpu=gpu)
    if c.revision != rec["revision"]:
        raise ResultsFileError(f"{src}: is revision {c.revision}, the adoption file names {rec['revision']}")
    prov = {k: types.MappingProxyType({**v, "adopted": True}) for k, v in c.provenance.items()}
    return dataclasses.replace(c, provenance=types.MappingProxyType(prov))


def adopt(gpu: str, revision: int, measured_by: Sequence[str | Path], reason: str, directory=None,
          results_root: Path | None = None) -> Path:
    """Make `revision` the one the megakernel builds from, given the megakernel results that
    measured the build with it. Refused unless every result is a megakernel.* result on `gpu`
    whose env.constants_revision is `revision`, and the reason is stated."""
    if not reason.strip():
        raise ResultsFileError("adopt: state the reason (what the measurement showed)")
    d = folder_of(directory)
    rev_file = f"history/{gpu_slug(gpu)}-r{int(revision):04d}.json"
    if not (d / rev_file).exists():
        raise ResultsFileError(f"adopt: {d / rev_file} does not exist")
    if not measured_by:
        raise ResultsFileError("adopt: name the megakernel results that measured the build with this revision "
                               "(--measured-by); a revision is never adopted unmeasured")
    rels = []
    for m in measured_by:
        p = Path(m)
        r = load(p)
        if not r.benchmark.startswith("megakernel."):
            raise ResultsFileError(f"adopt: {p} is a {r.benchmark} result, not a megakernel build's measurement")
        if r.env.gpu != gpu:
            raise ResultsFileError(f"adopt: {p} was measured on {r.env.gpu!r}, not {gpu!r}")
        if r.env.constants_revision != int(revision):
            raise ResultsFileError(f"adopt: {p} ran the build with constants revision {r.env.constants_revision!r}, "
                                   f"not {revision}: measure the build with it first (MEGABENCH_CONSTANTS="
                                   f"{d / rev_file})")
        try:
            rels.append(str(p.resolve().relative_to(REPO_ROOT)))
        except ValueError:
            rels.append(str(p))
    out = adoption_path(gpu, directory)
    prev = load_adoption(gpu, directory)
    history = list(prev.get("history", [])) + [{k: v for k, v in prev.items() if k != "history"}] if prev else []
    doc = {"schema": ADOPTION_SCHEMA, "version": VERSION, "gpu": gpu, "revision": int(revision),
           "revision_file": rev_file, "adopted": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "measured_by": rels, "reason": reason, "history": history}
    _write(out, doc)
    return out


# ----------------------------------------------------------------------------- CLI
def add_parser(sub) -> None:
    s = sub.add_parser("adopt", help="make a measured constants revision the one the megakernel builds from",
                       description=__doc__, formatter_class=_raw())
    s.add_argument("--gpu", default="NVIDIA H200", help="GPU model (default %(default)s)")
    s.add_argument("--revision", type=int, default=None, help="constants revision number (history/<gpu>-rNNNN.json)")
    s.add_argument("--measured-by", nargs="+", default=(), metavar="RESULT",
                   help="megakernel result files whose env.constants_revision is that revision")
    s.add_argument("--reason", default="", help="what the measurement showed")
    s.add_argument("--out", type=Path, default=None, help="constants folder (default reports/constants)")
    s.add_argument("--show", action="store_true", help="print the adoption and pins, change nothing")
    s.set_defaults(fn=_cmd)


def _raw():
    return argparse.RawDescriptionHelpFormatter


def _cmd(args) -> int:
    if args.show or args.revision is None:
        rec = load_adoption(args.gpu, args.out)
        print(json.dumps({"adoption": rec, "pins": {k: dataclasses.asdict(v) for k, v in
                                                    load_pins(args.gpu, args.out).items()}}, indent=1))
        return 0
    p = adopt(args.gpu, args.revision, args.measured_by, args.reason, args.out)
    print(f"adopted revision {args.revision} for {args.gpu}: {p}")
    return 0


# ----------------------------------------------------------------------------- older results
_AT_COMMIT: dict[tuple[str, str], int | None] = {}


def revision_at_commit(sha: str, gpu: str | None) -> int | None:
    """The constants revision the committed current file had at commit `sha` (what a megakernel
    result credited to that commit was built from, before results recorded it themselves); None
    when git or the file at that commit is not there."""
    key = (sha, gpu_slug(gpu))
    if key in _AT_COMMIT:
        return _AT_COMMIT[key]
    rev = None
    if re.fullmatch(r"[0-9a-f]{7,40}", sha or ""):
        try:
            out = subprocess.run(["git", "show", f"{sha}:reports/constants/{gpu_slug(gpu)}.json"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                r = json.loads(out.stdout).get("revision")
                rev = r if isinstance(r, int) else None
        except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
            rev = None
    _AT_COMMIT[key] = rev
    return rev


def result_revision(result) -> tuple[int | None, str]:
    """(constants revision, how it is known) for a megakernel result: recorded in its env, or,
    for results older than that field, read from the constants file at its commit."""
    if result.env.constants_revision is not None:
        return result.env.constants_revision, "recorded by the run"
    rev = revision_at_commit(result.env.git_sha, result.env.gpu)
    if rev is not None:
        return rev, f"the committed constants file at {result.env.git_sha[:7]}"
    return None, "not recorded (older result, commit's constants file not found)"
