"""`python -m microbench.testrun [--results DIR] [--time-limit S] [--log LOG | --resume LOG]
[-- PYTEST ARGS]` (also `megabench test-run`): run the README's test command, `python -m pytest
-q` plus the given args, and save what it gave as a small typed result, `tests.run`, under
<results>/tests/ (default $MEGABENCH_RESULTS or reports/results). The exit code is pytest's (a
child killed by signal N: 128 + N; stopped at the time limit: 124).

The result records the date, the commit the run is credited to (Env: git sha, dirty, as every
result; MEGABENCH_GIT_SHA / MEGABENCH_SOURCE_TREE on a copy), the machine (GPU or none, Python,
the host compiler g++ that builds the emulation, glibc, OS, CPU count), the counts passed /
failed / skipped / errors / xfailed / xpassed / deselected, the duration (host clock, one sample)
and the failing tests, each with the first line of what failed it (the exception's message, cut
to WHY_CHARS: a GPU session brings back no traceback). Its series say `gate_direction: none`: a
test run's wall time is not a kernel's performance and the gate lists it as not gated.

Counting is pytest's own: this module is also a pytest plugin, loaded in the child with
`-p microbench.testrun`. Its hooks append one JSON line per test report (and per collection
error, deselection, test start and session end) to the file named by $MEGABENCH_TESTRUN_LOG,
flushed at once, so the counts up to a crash survive it and the test that was running is named
(an interpreter abort, as the fortified glibc caused on the H200, ends pytest before its summary).
Under pytest-xdist only the controller writes (it receives every worker's reports).

A run stopped at its time limit can be finished by another (`--resume LOG`, where the first kept
its log with `--log LOG`): the same command at the same commit on the same GPU, it runs only the
tests that no earlier part finished (a test with its teardown reported), appends to the same log,
and its result counts every part: each test once, in the part that finished it. A resumed part
refuses a log of another command, commit or GPU, and a log whose run finished.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from .errors import MegabenchError, OutputError, ResultsFileError
from .results import REPO_ROOT, Derived, Env, Result, Series

LOG_ENV = "MEGABENCH_TESTRUN_LOG"
DONE_ENV = "MEGABENCH_TESTRUN_DONE"  # a file of the tests an earlier part finished: not collected again
PLUGIN = "microbench.testrun"  # this module, as `-p` names it in the child
BENCHMARK = "tests.run"
COUNTS = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed", "deselected")
README_COMMAND = ("-m", "pytest", "-q")  # the README's test command, after the interpreter
SLOWEST = 15  # the slowest tests a result names, with their seconds
WHY_CHARS = 400  # of a failure's message, kept in the result (the first line, cut)
WHY_KEPT = 60  # failures whose messages a result keeps (every failing test is still counted and named)
TIME_LIMIT_EXIT = 124  # as timeout(1)


# ------------------------------------------------------------------------- the plugin (in the child)
_log = None


def _emit(**rec) -> None:
    if _log is not None:
        _log.write(json.dumps(rec) + "\n")
        _log.flush()


def pytest_configure(config):
    global _log
    path = os.environ.get(LOG_ENV)
    if path and not hasattr(config, "workerinput"):  # an xdist worker: the controller counts
        _log = open(path, "a", encoding="utf-8")


def pytest_collectreport(report):
    if report.failed:
        _emit(event="collect_error", nodeid=report.nodeid)


_resuming = False  # set while this plugin deselects an earlier part's tests: not counted as deselected


def pytest_deselected(items):
    if not _resuming:
        _emit(event="deselected", n=len(items))


def base_id(nodeid: str) -> str:
    """A test's id without the `@group` that xdist's loadgroup appends (the reports carry it; the
    collection may not yet)."""
    head, at, tail = nodeid.rpartition("@")
    return head if at and tail and not any(c in tail for c in "[]:/") else nodeid


def pytest_collection_modifyitems(session, config, items):
    global _resuming
    path = os.environ.get(DONE_ENV)
    if not path:
        return
    done = set(Path(path).read_text(encoding="utf-8").splitlines())
    gone = [it for it in items if base_id(it.nodeid) in done]
    if gone:
        items[:] = [it for it in items if base_id(it.nodeid) not in done]
        _resuming = True
        try:
            config.hook.pytest_deselected(items=gone)  # pytest's summary shows them as deselected
        finally:
            _resuming = False
        _emit(event="resumed", n=len(gone))


def pytest_runtest_logstart(nodeid, location):
    _emit(event="start", nodeid=nodeid)


def _why(report) -> str:
    """The first line of a failed report's exception message (pytest's reprcrash; under xdist the
    controller's copy keeps it), else the last line of its text, at most WHY_CHARS."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if getattr(crash, "message", None):
        lines = crash.message.strip().splitlines()
        return (lines[0] if lines else "")[:WHY_CHARS]
    lines = str(getattr(report, "longrepr", "") or "").strip().splitlines()
    return (lines[-1] if lines else "")[:WHY_CHARS]


def pytest_runtest_logreport(report):
    rec = dict(event="report", nodeid=report.nodeid, when=report.when, outcome=report.outcome,
               xfail=hasattr(report, "wasxfail"), duration=round(float(getattr(report, "duration", 0.0) or 0.0), 4),
               gpu="gpu" in getattr(report, "keywords", {}))
    if report.failed:
        rec["why"] = _why(report)
    _emit(**rec)


def pytest_sessionfinish(session, exitstatus):
    _emit(event="finish", exitstatus=int(exitstatus))


def pytest_unconfigure(config):
    global _log
    if _log is not None:
        _log.close()
        _log = None


# ------------------------------------------------------------------------- counting (in the parent)
def count(lines) -> dict:
    """{count name: n, "failed_tests": [...], "last_started": nodeid, "finished": bool} from the
    plugin's JSON lines, in pytest's own categories: a failed setup or teardown is an error, a
    skip in any phase a skip, an expected failure xfailed, an unexpected pass xpassed."""
    c: Counter = Counter({k: 0 for k in COUNTS})
    failed, last, finished, open_tests = [], None, False, {}
    why: list[list[str]] = []  # [test, the first line of its failure]
    took: Counter = Counter()  # nodeid -> setup + call + teardown seconds
    gpu_ids: set[str] = set()
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off by a crash
        ev = r.get("event")
        if ev == "collect_error":
            c["errors"] += 1
            failed.append(r["nodeid"] or "<collection>")
        elif ev == "deselected":
            c["deselected"] += r["n"]
        elif ev == "start":
            last = r["nodeid"]
            open_tests[last] = True
        elif ev == "report":
            when, out, xf = r["when"], r["outcome"], r["xfail"]
            took[r["nodeid"]] += float(r.get("duration") or 0.0)
            if r.get("gpu"):
                gpu_ids.add(r["nodeid"])
            if when == "teardown":
                open_tests.pop(r["nodeid"], None)
            if out == "failed":
                key = "failed" if when == "call" else "errors"
                c[key] += 1
                failed.append(r["nodeid"] + ("" if when == "call" else f" ({when})"))
                if len(why) < WHY_KEPT:
                    why.append([failed[-1], r.get("why", "")])
            elif out == "skipped":
                c["xfailed" if xf else "skipped"] += 1
            elif when == "call":
                c["xpassed" if xf else "passed"] += 1
        elif ev == "finish":
            finished = True
    crashed_in = last if (last is not None and open_tests.get(last)) else None
    return {**{k: c[k] for k in COUNTS}, "failed_tests": failed, "failed_why": why, "running_when_stopped": crashed_in,
            "finished": finished, "slowest": [[n, round(t, 2)] for n, t in took.most_common(SLOWEST)],
            "test_seconds": round(sum(took.values()), 1),
            "gpu_test_seconds": round(sum(t for n, t in took.items() if n in gpu_ids), 1)}


# ------------------------------------------------------------------------- parts (a resumed run)
def _record(line: str) -> dict:
    """One log line's record; {} for a line cut off by a crash."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        return {}
    return r if isinstance(r, dict) else {}


def parts(lines) -> list[tuple[dict, list[str]]]:
    """The log's parts: (its `part` record, its lines), in order. Lines before the first part
    record (a log written by an older version) belong to no part and are refused by `resume_plan`."""
    out: list[tuple[dict, list[str]]] = []
    for line in lines:
        r = _record(line)
        if r.get("event") == "part":
            out.append((r, []))
        elif out:
            out[-1][1].append(line)
    return out


def finished_in(lines) -> set[str]:
    """The tests whose teardown a part reported: finished there, whatever their outcome."""
    return {r["nodeid"] for r in map(_record, lines) if r.get("event") == "report" and r.get("when") == "teardown"}


def earlier_reports(log_parts) -> tuple[list[str], set[str]]:
    """What the earlier parts count: each part's report lines of the tests it finished (a test
    stopped mid-way in one part and run again in a later one is counted in the later part only),
    and the ids of every finished test."""
    kept, done = [], set()
    for _, lines in log_parts:
        fin = finished_in(lines)
        kept += [line for line in lines if (r := _record(line)).get("event") == "report" and r["nodeid"] in fin]
        done |= fin
    return kept, done


def _part_seconds(lines) -> float:
    """A part's wall seconds, from its `part_end` record (0 for a part whose runner died first)."""
    ends = [r for r in map(_record, lines) if r.get("event") == "part_end"]
    try:
        return float(ends[-1].get("seconds") or 0.0) if ends else 0.0
    except (TypeError, ValueError):
        return 0.0


def part_record(args: list[str], env) -> dict:
    return {"event": "part", "args": list(args), "git_sha": env.git_sha, "git_dirty": bool(env.git_dirty),
            "gpu": env.gpu, "date": env.date}


def resume_plan(log_path: Path, args: list[str], env) -> list[tuple[dict, list[str]]]:
    """Check that `log_path` is a stopped run of this command, commit and GPU; its parts. Raises
    naming what does not match."""
    if not log_path.is_file():
        raise OutputError(f"--resume {log_path}: no such file" if not log_path.exists()
                          else f"--resume {log_path}: not a file")
    log_parts = parts(log_path.read_text(encoding="utf-8", errors="replace").splitlines())
    if not log_parts:
        raise ResultsFileError(f"--resume {log_path}: not a test-run log (no part record; write one with --log)")
    first, want = log_parts[0][0], part_record(args, env)
    for key, what in (("args", "pytest arguments"), ("git_sha", "commit"), ("git_dirty", "uncommitted changes"),
                      ("gpu", "GPU")):
        if first.get(key) != want[key]:
            raise ResultsFileError(f"--resume {log_path}: its run had {what} {first.get(key)!r}, this one "
                                   f"{want[key]!r}: a resumed run must be the same command at the same commit on "
                                   "the same GPU")
    if any(_record(line).get("event") == "finish" for _, lines in log_parts for line in lines):
        raise ResultsFileError(f"--resume {log_path}: that run finished; nothing is left to run")
    return log_parts


# ------------------------------------------------------------------------- the machine
def _first_line(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = (r.stdout or r.stderr).strip().splitlines()
    return out[0].strip() if r.returncode == 0 and out else None


def machine() -> dict[str, object]:
    """What the outcome may depend on beyond the commit: the GPU is in Env; this adds the host
    compiler (the emulation's g++), the C library, the OS and the CPU count."""
    libc, ver = platform.libc_ver()
    os_name = None
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {"python": platform.python_version(), "gxx": _first_line(["g++", "-dumpfullversion"]),
            "libc": f"{libc} {ver}".strip() or None, "os": os_name, "cpus": os.cpu_count(),
            "platform": platform.platform()}


# ------------------------------------------------------------------------- run + result
def run_pytest(args: list[str], log_path: Path, time_limit_s: float | None = None,
               python: str = sys.executable, done_path: Path | None = None) -> tuple[int, float, bool, list[str]]:
    """The README's test command with `args`, this module as a plugin; (exit code, seconds,
    stopped at the time limit, the command). `done_path`: a file of test ids not to run."""
    cmd = [python, *README_COMMAND, "-p", PLUGIN, *args]
    env = {**os.environ, LOG_ENV: str(log_path)}
    env.pop(DONE_ENV, None)
    if done_path is not None:
        env[DONE_ENV] = str(done_path)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])  # the plugin imports from the checkout
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: a time limit stops all of it
    stopped = False
    try:
        rc = proc.wait(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        stopped = True
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        rc = TIME_LIMIT_EXIT
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait()
        raise
    dur = time.monotonic() - t0
    if rc < 0:
        rc = 128 - rc  # killed by signal -rc, as a shell reports it
    return rc, dur, stopped, cmd


def to_result(counts: dict, exit_code: int, duration_s: float, cmd: list[str], stopped: bool,
              time_limit_s: float | None = None, part_seconds: list[float] | None = None, env=None):
    """`duration_s` is the whole command's: the sum of `part_seconds` where it ran in parts."""
    env = env or Env.capture()
    m = machine()
    shown = " ".join(["python", *cmd[1:]])
    params = {"command": shown, "gpu": env.gpu, **m}
    metrics = {**{k: counts[k] for k in COUNTS}, "exit_code": exit_code, "finished": counts["finished"],
               "stopped_at_time_limit": stopped, "gate_direction": "none",
               # seconds inside tests (setup + call + teardown) summed over workers; the GPU tests run
               # one after another in one worker (conftest.py), so theirs is a floor on the wall time
               "test_seconds": counts.get("test_seconds"), "gpu_test_seconds": counts.get("gpu_test_seconds"),
               "slowest": counts.get("slowest", []), "failed_why": counts.get("failed_why", []),
               "parts": len(part_seconds or [duration_s]), "part_seconds": [round(x, 1) for x in part_seconds or [duration_s]]}
    s = Series.from_samples("pytest/duration", [duration_s], timer="host", unit="s", params=params, metrics=metrics)
    rule = "pytest's own reports, counted by the microbench.testrun plugin in pytest's terminal categories"
    derived = {k: Derived(float(counts[k]), "count", rule) for k in COUNTS}
    derived["exit_code"] = Derived(float(exit_code), "", "pytest's exit status (128 + N: killed by signal N; "
                                   f"{TIME_LIMIT_EXIT}: stopped at the time limit)")
    notes = [f"command: {shown}", f"machine: GPU {env.gpu or 'none'}, Python {m['python']}, g++ {m['gxx']}, "
                                  f"{m['libc']}, {m['os']}, {m['cpus']} CPUs"]
    if part_seconds and len(part_seconds) > 1:
        notes.append(f"run in {len(part_seconds)} parts ({', '.join(f'{x:.0f}' for x in part_seconds)} s), the later "
                     "ones resumed from the earlier ones' log: each test counted once, in the part that finished it")
    if stopped:
        notes.append(f"stopped at the time limit of {time_limit_s:g} s; counts are those reported until then")
    elif not counts["finished"]:
        notes.append(f"pytest ended without finishing its session (exit {exit_code}); counts are those "
                     "reported until then")
    if counts["running_when_stopped"] and (stopped or not counts["finished"]):
        notes.append(f"running when it ended: {counts['running_when_stopped']}")
    if counts.get("slowest"):
        notes.append(f"GPU tests {counts['gpu_test_seconds']:g} s in all (one worker, one after another); slowest: "
                     + ", ".join(f"{n.split('::')[-1]} {t:g} s" for n, t in counts["slowest"][:5]))
    if counts["failed_tests"]:
        notes.append("failed: " + "; ".join(counts["failed_tests"][:20])
                     + (f" (+{len(counts['failed_tests']) - 20} more)" if len(counts["failed_tests"]) > 20 else ""))
    return Result(BENCHMARK, env, (s,), derived, quick=True, notes=tuple(notes))


def summary_line(counts: dict, exit_code: int, duration_s: float) -> str:
    parts = [f"{counts[k]} {k}" for k in COUNTS if counts[k] or k in ("passed", "failed", "skipped", "errors")]
    return f"{BENCHMARK}: {', '.join(parts)} in {duration_s:.1f} s (exit {exit_code})"


def run_tests(args: list[str], results: Path | None = None, time_limit_s: float | None = None,
             save: bool = True, log=print, keep_log: Path | None = None,
             resume: Path | None = None) -> tuple[int, object, Path | None]:
    """Run, count, save. Returns (exit code, the Result, the saved file or None). `keep_log`: write
    the reports log there (a new file) for a later `resume`; `resume`: finish the stopped run whose
    log that is, appending to it."""
    if results is not None and not Path(results).is_dir():  # a typo: refused before an hour of tests
        raise OutputError(f"results folder {results} does not exist" if not Path(results).exists()
                          else f"results folder {results} is not a folder")
    if keep_log is not None and resume is not None:
        raise OutputError("--log and --resume: a resumed run appends to the log it resumes")
    if keep_log is not None and (Path(keep_log).exists() or not Path(keep_log).parent.is_dir()):
        raise OutputError(f"--log {keep_log}: already exists (a log is never overwritten; --resume continues it)"
                          if Path(keep_log).exists() else f"--log {keep_log}: folder {Path(keep_log).parent} does not exist")
    env = Env.capture()
    earlier, done, part_s = [], set(), []
    if resume is not None:
        log_parts = resume_plan(Path(resume), args, env)
        earlier, done = earlier_reports(log_parts)
        part_s = [_part_seconds(lines) for _, lines in log_parts]
    with tempfile.TemporaryDirectory(prefix="megabench-testrun-") as d:
        lp = Path(resume or keep_log or Path(d) / "reports.jsonl")
        with open(lp, "a", encoding="utf-8") as f:
            f.write(json.dumps(part_record(args, env)) + "\n")
        start = lp.stat().st_size
        done_path = None
        if done:
            done_path = Path(d) / "done.txt"
            done_path.write_text("".join(base_id(n) + "\n" for n in sorted(done)), encoding="utf-8")
        rc, dur, stopped, cmd = run_pytest(args, lp, time_limit_s, done_path=done_path)
        with open(lp, "rb") as f:
            f.seek(start)
            mine = f.read().decode("utf-8", errors="replace").splitlines()
        with open(lp, "a", encoding="utf-8") as f:  # the part's own seconds, for the next part's total
            f.write(json.dumps({"event": "part_end", "seconds": round(dur, 3), "exit": rc}) + "\n")
        counts = count([*earlier, *mine])
    part_s.append(dur)
    if rc == 5 and done and not counts["failed"] and not counts["errors"]:
        rc = 0  # pytest's "no tests collected": every test had finished in an earlier part
    if rc == 0 and (counts["failed"] or counts["errors"]):
        rc = 1  # an earlier part's failure fails the whole command
    res = to_result(counts, rc, sum(part_s), cmd, stopped, time_limit_s, part_seconds=part_s, env=env)
    path = res.save(results) if save else None
    log(summary_line(counts, rc, dur) + (f"; saved {path}" if path else ""))
    for n in res.notes[2:]:
        log(f"  {n}")
    return rc, res, path


# ------------------------------------------------------------------------- CLI
def _add_args(p) -> None:
    p.add_argument("--results", type=Path, default=None,
                   help="results root (default $MEGABENCH_RESULTS or reports/results); must exist")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="stop pytest after S seconds and still save what it reported (exit 124)")
    p.add_argument("--no-save", action="store_true", help="count and print, write no result")
    p.add_argument("--log", type=Path, default=None, metavar="LOG",
                   help="keep the run's reports log in LOG (a new file): a run stopped at its time limit can be "
                        "finished later with --resume LOG")
    p.add_argument("--resume", type=Path, default=None, metavar="LOG",
                   help="finish the stopped run whose log is LOG: the same command, commit and GPU, only the tests "
                        "no earlier part finished; appends to LOG; the result counts every part")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER,
                   help="after `--`: arguments appended to `python -m pytest -q`")


def add_parser(sub) -> None:
    s = sub.add_parser("test-run", help="the README's test command, its counts and duration saved as a typed "
                       "result (tests.run)", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(s)
    s.set_defaults(fn=_cmd)


def _cmd(a) -> int:
    args = a.pytest_args[1:] if a.pytest_args[:1] == ["--"] else a.pytest_args
    rc, _, _ = run_tests(args, a.results, a.time_limit, save=not a.no_save, keep_log=a.log, resume=a.resume)
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m microbench.testrun", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    a = p.parse_args(argv)

    try:
        return _cmd(a)
    except MegabenchError as e:
        print(f"python -m microbench.testrun: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
