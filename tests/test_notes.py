"""The notes are named by topic and indexed, the paths that point at them resolve, and the published
sources the notes quote are in reports/references.json with what each says. Each check is a
function of text returning its problems; every test runs it on the repository and on a mutated
copy of the same text, which must show a problem, so the check can fail."""
from __future__ import annotations

import json
import re
from pathlib import Path

from microbench.results import REPO_ROOT

NOTES = REPO_ROOT / "reports" / "notes"
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
NOTE_PATH = re.compile(r"reports/notes/[A-Za-z0-9_.-]+\.md")
DATED = re.compile(r"^\d{4}-\d{2}-\d{2}|session-?\d")


def index_problems(index_text: str, note_files: set[str]) -> list[str]:
    """Notes missing from the index, and index entries naming no note."""
    listed = {t for t in LINK.findall(index_text) if "/" not in t and t.endswith(".md")}
    return ([f"{n} is not in reports/notes/README.md" for n in sorted(note_files - listed)]
            + [f"the index names {n}, which does not exist" for n in sorted(listed - note_files)])


def test_every_note_is_indexed_and_named_by_topic():
    files = {p.name for p in NOTES.glob("*.md") if p.name != "README.md"}
    index = (NOTES / "README.md").read_text()
    assert index_problems(index, files) == []
    assert not [n for n in files if DATED.search(n)], "a note named by date or session, not by topic"
    some = sorted(files)[0]
    assert index_problems(index.replace(f"]({some})", "](gone.md)"), files)  # the mutation is seen


def path_problems(text: str, source: Path) -> list[str]:
    """reports/notes paths (repository-relative) and relative markdown links into reports/notes
    or docs/ that name no file."""
    bad = [p for p in NOTE_PATH.findall(text) if not (REPO_ROOT / p).is_file()]
    for target in LINK.findall(text):
        if "://" in target or not target.endswith(".md"):
            continue
        full = (source.parent / target).resolve()
        inside = full.is_relative_to(NOTES.resolve()) or full == (REPO_ROOT / "docs" / "STATUS.md").resolve()
        if inside and not full.is_file():
            bad.append(target)
    return [f"{source.relative_to(REPO_ROOT)}: {b}" for b in bad]


def _pointing_files() -> list[Path]:
    """The files a rename of a note must update: the user docs, the notes, the report's code and
    the sources that cite a note."""
    out = [REPO_ROOT / "README.md", REPO_ROOT / "docs" / "STATUS.md", *sorted(NOTES.glob("*.md"))]
    for pkg in ("reports", "microbench", "megakernel"):
        out += sorted((REPO_ROOT / pkg).rglob("*.py"))
    return out


def test_paths_to_notes_resolve():
    bad = [b for p in _pointing_files() for b in path_problems(p.read_text(errors="replace"), p)]
    assert not bad, bad
    readme = REPO_ROOT / "README.md"
    assert path_problems("see reports/notes/2026-12-01-h200-session.md", readme)
    assert path_problems("[log](reports/notes/nope.md)", readme)
    assert not path_problems("[log](reports/notes/h200-sessions.md)", readme)


def reference_problems(refs: dict, note_text: str) -> list[str]:
    """Sources without what they say or where they are, and `key`s a note's text cites that
    references.json does not hold (a cited key: a backticked run of lower-case words joined by
    dashes, as the sources are named)."""
    bad = [f"{k}: no {f}" for k, s in refs.items() for f in ("what", "where") if not str(s.get(f, "")).strip()]
    cited = set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`", note_text))
    return bad + [f"the note cites `{k}`, not in references.json" for k in sorted(cited - set(refs))]


def test_the_peer_note_cites_only_recorded_sources():
    refs = json.loads((REPO_ROOT / "reports" / "references.json").read_text())["sources"]
    text = (NOTES / "peer-baseline.md").read_text()
    head = "## What a serving engine runs instead\n"
    assert head in text
    note = text[text.index(head):].split("\n## ", 1)[0]  # the section that quotes the sources
    assert reference_problems(refs, note) == []
    assert "`vllm-nvfp4-moe-oracle`" in note and "`flaggems-pr3222-marlin-moe-h20`" in note
    assert reference_problems(refs, note + " (`vllm-nonexistent-source`)")
    assert reference_problems({**refs, "x-y": {"what": "", "where": "w"}}, note)
    # a source we could not verify is recorded as such, and no figure of it is quoted in the note
    assert "NOT FOUND" in refs["flaggems-pr3609"]["verified"] and "not quoted" in note
