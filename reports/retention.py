"""The retention rule for the results folder, and `megabench prune-results [--dry-run]`.

Every run adds results, timelines and profiler dumps; the GPU machine receives the whole tree on
every run, so the folder keeps what is still read and git history keeps the rest. A file is kept
when one of these reasons holds (a file may have several; all are printed):

  newest    the newest result of its benchmark on its GPU: what `megabench tune`, the report and
            the gate's newest-run baselines read
  report    a run the report shows although a newer one exists: each torch baseline's fastest
            committed run at a configuration the latest results have
            (reports/megakernel.py fastest_baselines), and the run holding the newest peer row
            at each configuration (a later run without the peer does not hide it:
            reports/build.py step_sources)
  note      a markdown note in the results folder (`*.md`: results notes, ncu stall summaries):
            notes are never pruned
  named     a file something names by file name or stem: any text file of the repository outside
            the results folder (the lever index reports/LEVERS.md, notes under reports/notes, the
            constants files and their history, tests, sources, CI scripts, docs) or any file kept
            for another reason here, so a kept gate.quality keeps the runs it replayed, a kept
            note the results it cites, and so on to a fixpoint. A result's record of its own trace file keeps no artefact (that is the
            trace rule's job: the result still names it, git history has it). A markdown file's glob (`bench-xgpu-*.json`, a literal prefix of
            at least GLOB_PREFIX characters) names every file it matches, and so does a name with its
            middle elided (`megakernel.ab-<stamp>-...json`, `...T020839Z-...json`). A bare commit
            hash names no file. REPORT.md does not count: it is regenerated from what is kept.
  trace     the newest artefact group of its kind. Artefacts are the files that are not results
            (Perfetto traces and their plots, Nsight Compute dumps, pytest-benchmark JSON); a group
            is the files of one stem (`<kind>-<stamp>-...-<sha>` plus `.trace.json.gz`, `.png`,
            `-details.txt`, `-sass.csv.gz`, ...), its kind the stem with stamp, GPU and commit taken
            out: one timeline, one detail trace, one dump per profiled op.
Everything else is pruned. Nothing is deleted until the whole plan is made, and then by renames
into one temporary folder that is removed last (a failed rename moves every file back).
"""
from __future__ import annotations

import argparse
import fnmatch
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from microbench.errors import ResultsFileError
from microbench.results import REPO_ROOT, SCHEMA, Result, results_root

from . import megakernel as mk

GLOB_PREFIX = 6
ARTEFACT_SUFFIXES = (".trace.json.gz", ".trace.json", "-details.txt", "-sass.csv.gz", "-stalls.md", ".png",
                     ".json.gz", ".json", ".csv.gz", ".csv", ".txt", ".gz")
TEXT_SUFFIXES = (".md", ".py", ".json", ".txt", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".cu", ".cuh", ".h",
                 ".sh", ".csv")
MAX_TEXT_BYTES = 8 << 20
# outside the results folder: folders whose files name nothing that must be kept
SKIP_DIRS = {".git", "__pycache__", "node_modules", "out", "figures"}
STAMP = re.compile(r"(\d{8}T\d{4,6}Z)")
# a name with a stamp in it, or a glob of one (`bench-xgpu-*.json`: a literal prefix, one star, a
# suffix ending in an extension; markdown's **bold** is no glob)
NAME_TOKEN = re.compile(r"[A-Za-z0-9_.\-*]*\d{8}T\d{4,6}Z[A-Za-z0-9_.\-*]*"
                        r"|[A-Za-z0-9_.\-]{%d,}\*[A-Za-z0-9_\-]*\.[A-Za-z0-9.]*[A-Za-z0-9]"
                        r"|\.\.\.T\d{4,6}Z[A-Za-z0-9_.\-]*" % GLOB_PREFIX)
ELIDED = re.compile(r"\.\.\.+")  # `megakernel.ab-20261201T020352Z-...json`: a name with its middle left out
KIND = re.compile(r"\d{8}T\d{4,6}Z.*?-[0-9a-f]{7,40}(?=$|-)")


def stem(name: str) -> str:
    """A file name without its artefact/result suffix: the name a note or a result uses for it."""
    for suf in ARTEFACT_SUFFIXES:
        if name.endswith(suf):
            return name[:-len(suf)]
    return name


def kind(s: str) -> str:
    """`timeline-shard8-T16-20990101T000000Z-0000000` -> `timeline-shard8-T16-*`."""
    return KIND.sub("*", s, count=1)


def _stamp_key(name: str) -> str:
    m = STAMP.search(name)
    if not m:
        return ""
    d, t = m.group(1)[:-1].split("T")
    return d + t.ljust(6, "0")


@dataclass
class Entry:
    path: Path
    size: int
    result: dict | None = None  # the result's header (benchmark, env) when it is one
    reasons: list[str] = field(default_factory=list)


@dataclass
class Plan:
    root: Path
    entries: dict[Path, Entry]

    @property
    def kept(self) -> list[Entry]:
        return [e for _, e in sorted(self.entries.items()) if e.reasons]

    @property
    def pruned(self) -> list[Entry]:
        return [e for _, e in sorted(self.entries.items()) if not e.reasons]

    def describe(self) -> list[str]:
        def mb(es: Iterable[Entry]) -> str:
            return f"{sum(e.size for e in es) / 1e6:.1f} MB"

        out = [f"keep {_rel(e.path, self.root)}: {'; '.join(e.reasons)}" for e in self.kept]
        out += [f"prune {_rel(e.path, self.root)} ({e.size / 1e3:.0f} kB)" for e in self.pruned]
        why: dict[str, int] = {}
        for e in self.kept:
            for r in {r.split(" ")[0] for r in e.reasons}:
                why[r] = why.get(r, 0) + 1
        out.append(f"kept {len(self.kept)} files ({mb(self.kept)}; by reason: "
                   + ", ".join(f"{k} {v}" for k, v in sorted(why.items())) + f"), prune {len(self.pruned)} files "
                   f"({mb(self.pruned)}) under {self.root}")
        return out


def _rel(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)


def _read_text(p: Path) -> str:
    try:
        raw = p.read_bytes()
        if p.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        return raw.decode("utf-8", errors="replace")
    except (OSError, EOFError) as e:
        raise ResultsFileError(f"{p}: cannot be read ({e})") from None


def _result_header(p: Path) -> dict | None:
    if not (p.name.endswith(".json") or p.name.endswith(".json.gz")) or ".trace." in p.name:
        return None
    try:
        d = json.loads(_read_text(p))
    except ValueError:
        raise ResultsFileError(f"{p}: not valid JSON; fix or remove it before pruning") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        return None
    env = d.get("env") or {}
    return {"benchmark": d.get("benchmark"), "gpu": env.get("gpu"), "date": env.get("date") or "",
            "sha": str(env.get("git_sha") or "")[:7], "doc": d}


def _referrer_files(repo: Path, root: Path) -> list[Path]:
    """Text files of the repository outside the results folder that may name results."""
    out = []
    root = root.resolve()
    for dirpath, dirnames, filenames in os.walk(repo):
        d = Path(dirpath)
        if d.resolve() == root:
            dirnames[:] = []
            continue
        dirnames[:] = sorted(n for n in dirnames if n not in SKIP_DIRS and not n.endswith(".egg-info")
                             and (not n.startswith(".") or n == ".ci"))
        for n in sorted(filenames):
            p = d / n
            if n == "REPORT.md" or n.startswith(".") or (not n.endswith(TEXT_SUFFIXES) and d.name != ".ci"):
                continue
            try:
                if p.stat().st_size <= MAX_TEXT_BYTES:
                    out.append(p)
            except OSError:
                continue
    return out


# a shell brace list in a name (`megakernel.decode-20261205T12{2226,2323}Z-*`): the names it stands for
# are named too; unexpanded, the stamp pattern never matches and the files looked unnamed
BRACED = re.compile(r"[A-Za-z0-9_.\-*]*\{[A-Za-z0-9_.\-,]*,[A-Za-z0-9_.\-,]*\}[A-Za-z0-9_.\-*{},]*")
BRACE = re.compile(r"\{([^{}]*)\}")


def _expand_braces(tok: str) -> list[str]:
    m = BRACE.search(tok)
    if m is None:
        return [tok]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(tok[:m.start()] + alt + tok[m.end():])]


def _names(text: str, markdown: bool) -> tuple[set[str], list[str]]:
    """(stems named, glob patterns) in a text; in markdown, brace lists expanded as the shell does."""
    stems, globs = set(), []
    if markdown:
        text = text + "\n" + " ".join(x for tok in BRACED.findall(text) for x in _expand_braces(tok))
    for tok in NAME_TOKEN.findall(text):
        elided = "..." in tok
        tok = ELIDED.sub("*", tok.rstrip(".-")).lstrip(".-")
        if "*" in tok:
            if markdown and (elided or len(tok.split("*", 1)[0]) >= GLOB_PREFIX):
                globs.append(tok if tok.endswith("*") or "." in tok.rsplit("*", 1)[-1] else tok + "*")
        elif tok:
            stems.add(stem(tok))
    return stems, globs


def plan(root: Path | None = None, repo: Path | None = None) -> Plan:
    """What the retention rule keeps under `root` (default the results root), and why. Reads the
    whole folder first: a results file that cannot be parsed stops the plan (ResultsFileError)."""
    root = Path(root) if root else results_root()
    repo = Path(repo) if repo else REPO_ROOT
    if not root.is_dir():
        raise ResultsFileError(f"{root}: no such results folder")
    entries: dict[Path, Entry] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.startswith(".") and not any(x.startswith(".") for x in p.relative_to(root).parts):
            entries[p] = Entry(p, p.stat().st_size, _result_header(p))

    # newest per (benchmark, GPU)
    newest: dict[tuple, Entry] = {}
    for e in entries.values():
        if e.result:
            k = (e.result["benchmark"], e.result["gpu"])
            if k not in newest or (e.result["date"], e.path.name) > (newest[k].result["date"], newest[k].path.name):
                newest[k] = e
    for (bench, gpu), e in newest.items():
        e.reasons.append(f"newest {bench} on {gpu}")

    # the runs the report shows besides the newest: each torch baseline's fastest run

    for gpu in sorted({g for _, g in newest}, key=str):
        latest = [Result.from_json(e.result["doc"], str(e.path)) for (b, g), e in newest.items() if g == gpu]
        model = [(e, Result.from_json(e.result["doc"], str(e.path))) for e in entries.values()
                 if e.result and e.result["gpu"] == gpu and str(e.result["benchmark"]).startswith("model.")]
        best = mk.fastest_baselines([r for _, r in model])
        for row in mk.step_rows(latest):
            b = best.get((row.impl, row.config))
            if b is None or not row.benchmark.startswith("model."):
                continue
            for e, r in model:
                if (r.benchmark, r.env.date, r.env.git_sha[:7]) == (b.benchmark, b.date, b.commit):
                    why = f"report (fastest {b.impl} run at {mk.config_label(b.config)})"
                    if why not in e.reasons:
                        e.reasons.append(why)

        # the newest peer row per configuration, wherever it is (build.py step_sources)
        peer: dict[tuple, tuple] = {}
        for e in entries.values():
            if not (e.result and e.result["gpu"] == gpu and e.result["benchmark"] in ("megakernel.step",
                                                                                    "megakernel.peer")):
                continue
            for row in mk.step_rows([Result.from_json(e.result["doc"], str(e.path))]):
                if row.impl == "peer" and (row.config not in peer or (row.date, e.path.name) > peer[row.config][0]):
                    peer[row.config] = ((row.date, e.path.name), e)
        for config, (_, e) in peer.items():
            why = f"report (newest peer row at {mk.config_label(config)})"
            if not any(r.startswith("report (newest peer row") for r in e.reasons):
                e.reasons.append(why)

    for e in entries.values():
        if e.path.name.endswith(".md"):
            e.reasons.append("note")

    # newest artefact group per kind
    groups: dict[str, dict[str, list[Entry]]] = {}
    for e in entries.values():
        if e.result is None and not e.path.name.endswith(".md"):
            s = stem(e.path.name)
            groups.setdefault(kind(s), {}).setdefault(s, []).append(e)
    for k, by_stem in groups.items():
        s = max(by_stem, key=lambda x: (_stamp_key(x), x))
        for e in by_stem[s]:
            e.reasons.append(f"trace (newest of kind {k})")

    # names, from the repository and then from every kept file, to a fixpoint
    by_stem: dict[str, list[Entry]] = {}
    for e in entries.values():
        by_stem.setdefault(stem(e.path.name), []).append(e)

    def mark(text: str, markdown: bool, source: str, results_only: bool = False) -> list[Entry]:
        stems, globs = _names(text, markdown)
        new = []
        hits = [e for s in stems for e in by_stem.get(s, ())]
        hits += [e for g in globs for e in entries.values() if fnmatch.fnmatch(e.path.name, g)]
        for e in hits:
            if results_only and e.result is None:
                continue
            why = f"named by {source}"
            if not any(r.startswith("named by") for r in e.reasons):
                new.append(e)
            if why not in e.reasons and sum(r.startswith("named by") for r in e.reasons) < 3:
                e.reasons.append(why)
        return new

    for p in _referrer_files(repo, root):
        mark(_read_text(p), p.name.endswith(".md"), _rel(p, repo))
    todo = [e for e in entries.values() if e.reasons]
    done: set[Path] = set()
    while todo:
        e = todo.pop()
        if e.path in done:
            continue
        done.add(e.path)
        if e.size <= MAX_TEXT_BYTES and (e.result or e.path.name.endswith((".md", ".txt", ".json"))):
            text = json.dumps(e.result["doc"]) if e.result else _read_text(e.path)
            todo += mark(text, e.path.name.endswith(".md"), _rel(e.path, root), results_only=e.result is not None)
    return Plan(root, entries)


def prune(p: Plan) -> None:
    """Delete the plan's pruned files: every one renamed into a temporary folder first (all or
    none), then that folder removed."""
    victims = p.pruned
    if not victims:
        return
    trash = Path(tempfile.mkdtemp(prefix=".prune-", dir=p.root))
    moved = []
    try:
        for i, e in enumerate(victims):
            dst = trash / f"{i:05d}-{e.path.name}"
            os.replace(e.path, dst)
            moved.append((e.path, dst))
    except OSError as err:
        for src, dst in reversed(moved):
            os.replace(dst, src)
        shutil.rmtree(trash, ignore_errors=True)
        raise ResultsFileError(f"{p.root}: pruning stopped, nothing removed ({err})") from None
    shutil.rmtree(trash)
    for d in sorted({e.path.parent for e in victims}, key=lambda x: -len(x.parts)):
        if d != p.root and d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def add_parser(sub) -> None:
    s = sub.add_parser("prune-results", help="apply the retention rule to the results folder (see reports/retention.py)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--results", type=Path, default=None,
                   help="results root (default $MEGABENCH_RESULTS or reports/results)")
    s.add_argument("--repo", type=Path, default=None, help="repository whose files may name results (default: this one)")
    s.add_argument("--dry-run", action="store_true", help="print what would be kept and pruned; delete nothing")
    s.add_argument("--quiet", action="store_true", help="print the totals only")
    s.set_defaults(fn=_cmd)


def _cmd(args) -> int:
    p = plan(args.results, args.repo)
    lines = p.describe()
    for line in (lines[-1:] if args.quiet else lines):
        print(line)
    if args.dry_run:
        print("dry run: nothing deleted")
        return 0
    prune(p)
    print(f"pruned {len(p.pruned)} files")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m reports.retention")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    a = ap.parse_args(["prune-results", *sys.argv[1:]])
    sys.exit(a.fn(a))
