"""Kernel-metrics gate (`megabench gate --kernels`): recompiles every .cu in the repository on the
CPU (NVRTC, the defines recorded in the baseline; none for a new source) and compares registers,
spills, static shared memory and code bytes with reports/kernel_metrics.json. Fails when spills
grow by more than --max-spill-increase bytes (default 0), registers by more than
--max-reg-increase (default 0), static smem by more than --max-smem-increase bytes (default 0), or
code bytes by more than --max-code-increase percent (default 10). `--update` rewrites the baseline.

Exit codes: 0 no metric grew beyond its threshold (new kernels are listed, not failed); 1 a metric
grew beyond its threshold; 2 bad input (an unreadable baseline, a kernel that fails to compile).
"""
from __future__ import annotations

import datetime as _dt
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from . import atomic
from .compiler import DEFAULT_ARCH, all_cuda_sources, compile_cuda, toolchain_versions
from .errors import ResultsFileError
from .gate import EXIT_OK, EXIT_REGRESSION
from .results import REPO_ROOT, _git


KM_SCHEMA = "megabench.kernel_metrics"
KM_VERSION = 1
KM_FIELDS = ("registers", "spill_store_bytes", "spill_load_bytes", "stack_frame_bytes", "static_smem_bytes",
             "barriers", "code_bytes")


def kernel_metrics_path() -> Path:
    return REPO_ROOT / "reports" / "kernel_metrics.json"


@dataclass(frozen=True)
class KernelThresholds:
    max_spill_increase: int = 0  # bytes (stores + loads)
    max_reg_increase: int = 0  # registers per thread
    max_smem_increase: int = 0  # bytes of static shared memory
    max_code_increase_pct: float = 10.0

    def describe(self) -> str:
        return (f"fail when spills grow > {self.max_spill_increase} B, registers > +{self.max_reg_increase}, "
                f"static smem > +{self.max_smem_increase} B, or code bytes > +{self.max_code_increase_pct:g}%")


def _tracked_cu(root: Path) -> set[str] | None:
    out = _git("ls-files", "*.cu")
    return set(out.splitlines()) if out else None


def _build_key(source: str, defines: Mapping[str, str]) -> str:
    return source + ("" if not defines else "[" + ",".join(f"{k}={v}" for k, v in sorted(defines.items())) + "]")


def load_kernel_baseline(path: Path | None = None) -> dict:
    p = Path(path) if path else kernel_metrics_path()
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ResultsFileError(f"{p}: no kernel-metrics baseline; create it with `megabench gate --kernels --update`") from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("schema") != KM_SCHEMA:
        raise ResultsFileError(f"{p}: schema is {d.get('schema') if isinstance(d, dict) else None!r}, expected {KM_SCHEMA!r}")
    v = d.get("version")
    if not isinstance(v, int) or v > KM_VERSION:
        raise ResultsFileError(f"{p}: kernel-metrics version {v!r} (this reads up to {KM_VERSION})")
    if not isinstance(d.get("builds"), list):
        raise ResultsFileError(f"{p}: no 'builds' list")
    for i, b in enumerate(d["builds"]):
        if not isinstance(b, dict) or not isinstance(b.get("source"), str) or not isinstance(b.get("kernels"), dict):
            raise ResultsFileError(f"{p}: build #{i} malformed (needs source, defines, kernels)")
        for kname, m in b["kernels"].items():
            lacking = [f for f in KM_FIELDS if not isinstance(m.get(f) if isinstance(m, dict) else None, int)]
            if lacking:
                raise ResultsFileError(f"{p}: {b['source']} kernel {kname}: missing/non-integer {lacking}")
    return d


def measure_kernels(builds: Sequence[tuple[str, Mapping[str, str]]], arch: str = "sm_90a") -> dict[str, dict]:
    """{build key: {"source", "defines", "kernels": {kernel: metrics}}} compiled now (NVRTC, CPU)."""
    out = {}
    for src, defs in builds:
        p = REPO_ROOT / src
        mod = compile_cuda(p, arch=arch, defines=dict(defs))
        kernels = {k: {f: int(getattr(u, f)) for f in KM_FIELDS} for k, u in sorted(mod.resources.items())}
        out[_build_key(src, defs)] = {"source": src, "defines": dict(defs), "kernels": kernels}
    return out


def planned_builds(baseline: dict | None, tracked_only: bool = False,
                   only: Sequence[str] | None = None) -> tuple[list[tuple[str, dict]], list[str]]:
    """Builds to compile: the baseline's (source, defines) records whose source still exists, plus
    every other .cu with no defines. Returns (builds, baseline sources that vanished)."""
    # never a virtual environment's or another hidden folder's sources (a CI venv inside the checkout
    # ships numba/torch .cu files that are not ours)
    present = [str(p.relative_to(REPO_ROOT)) for p in all_cuda_sources()
               if not any(part.startswith(".") or part == "site-packages" for part in p.relative_to(REPO_ROOT).parts)]
    if tracked_only:
        tracked = _tracked_cu(REPO_ROOT)
        if tracked is not None:
            present = [p for p in present if p in tracked]
    if only:
        missing = sorted(set(only) - set(present))
        if missing:
            raise ResultsFileError(f"no such .cu in the repository: {missing}")
        present = [p for p in present if p in only]
    builds, gone, covered = [], [], set()
    for b in (baseline or {}).get("builds", []):
        if only and b["source"] not in only:
            continue
        if b["source"] in present:
            builds.append((b["source"], {str(k): str(v) for k, v in (b.get("defines") or {}).items()}))
            covered.add(b["source"])
        else:
            gone.append(b["source"])
    builds += [(s, {}) for s in present if s not in covered]
    return builds, gone


def compare_kernels(baseline: dict, current: Mapping[str, dict], th: KernelThresholds = KernelThresholds()):
    """Rows of every kernel whose metrics changed, appeared or vanished, and the failures among them."""
    base = {_build_key(b["source"], b.get("defines") or {}): b for b in baseline.get("builds", [])}
    rows, failures = [], []
    for bk in sorted(set(base) | set(current)):
        bk_base = base.get(bk, {}).get("kernels", {})
        bk_cur = current.get(bk, {}).get("kernels", {})
        for kname in sorted(set(bk_base) | set(bk_cur)):
            o, n = bk_base.get(kname), bk_cur.get(kname)
            if o is None or n is None:
                if bk not in current and bk in base:
                    continue  # vanished sources are reported separately
                rows.append({"build": bk, "kernel": kname, "change": "new kernel" if o is None else "kernel removed",
                             "verdict": "info"})
                continue
            diffs, fails = [], []
            ospill = o["spill_store_bytes"] + o["spill_load_bytes"]
            nspill = n["spill_store_bytes"] + n["spill_load_bytes"]
            if nspill != ospill:
                diffs.append(f"spills {ospill}->{nspill} B")
                if nspill - ospill > th.max_spill_increase:
                    fails.append("spills")
            if n["registers"] != o["registers"]:
                diffs.append(f"registers {o['registers']}->{n['registers']}")
                if n["registers"] - o["registers"] > th.max_reg_increase:
                    fails.append("registers")
            if n["static_smem_bytes"] != o["static_smem_bytes"]:
                diffs.append(f"smem {o['static_smem_bytes']}->{n['static_smem_bytes']} B")
                if n["static_smem_bytes"] - o["static_smem_bytes"] > th.max_smem_increase:
                    fails.append("smem")
            if n["code_bytes"] != o["code_bytes"]:
                pct = 100.0 * (n["code_bytes"] - o["code_bytes"]) / max(1, o["code_bytes"])
                diffs.append(f"code {o['code_bytes']}->{n['code_bytes']} B ({pct:+.1f}%)")
                if pct > th.max_code_increase_pct:
                    fails.append("code bytes")
            for f in ("stack_frame_bytes", "barriers"):
                if n[f] != o[f]:
                    diffs.append(f"{f.replace('_', ' ')} {o[f]}->{n[f]}")
            if diffs:
                row = {"build": bk, "kernel": kname, "change": "; ".join(diffs),
                       "verdict": ("FAIL: " + ", ".join(fails)) if fails else "ok"}
                rows.append(row)
                if fails:
                    failures.append(row)
    return rows, failures


def kernel_gate(update: bool = False, path: Path | None = None, th: KernelThresholds = KernelThresholds(),
                tracked_only: bool = False, out=sys.stdout, only: Sequence[str] | None = None) -> int:
    p = Path(path) if path else kernel_metrics_path()
    if update:
        atomic.check_writable(p)  # a baseline path in a folder that is not there: refused before compiling
    baseline = None
    if p.exists() or not update:
        baseline = load_kernel_baseline(p)
    if update and only:
        raise ResultsFileError("--update rewrites the whole baseline: do not combine it with --source")
    builds, gone = planned_builds(baseline, tracked_only, only)
    arch = (baseline or {}).get("arch", DEFAULT_ARCH)
    current = measure_kernels(builds, arch)
    tool = toolchain_versions()
    nk = sum(len(b["kernels"]) for b in current.values())
    if only and baseline:
        baseline = {**baseline, "builds": [b for b in baseline["builds"] if b["source"] in only]}
    rows, failures = compare_kernels(baseline or {"builds": []}, current, th)
    print(f"kernel metrics: {len(current)} builds, {nk} kernels compiled for {arch} (NVRTC {tool.get('nvrtc')})",
          file=out)
    if baseline and baseline.get("toolchain", {}).get("nvrtc") != tool.get("nvrtc"):
        print(f"WARNING: baseline was compiled with NVRTC {baseline.get('toolchain', {}).get('nvrtc')}, this is "
              f"{tool.get('nvrtc')}: differences may be the compiler's, not the code's", file=out)
    if gone:
        print(f"sources in the baseline that no longer exist: {', '.join(gone)}", file=out)
    if rows:
        print(tabulate(rows, headers="keys", tablefmt="github"), file=out)
    else:
        print("no kernel changed", file=out)
    print(th.describe(), file=out)
    if update:
        doc = {"schema": KM_SCHEMA, "version": KM_VERSION, "arch": arch,
               "toolchain": {k: v for k, v in tool.items()},
               "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "note": "Deterministic compile metrics per kernel (NVRTC -> cubin, ptxas -v and ELF sections). "
                       "CI recompiles every .cu and fails on increases: `megabench gate --kernels`. "
                       "Regenerate deliberately with `megabench gate --kernels --update` and commit it with the change.",
               "builds": [current[k] for k in sorted(current)]}
        atomic.write_json(p, doc)  # every kernel compiled and measured above: nothing half-written
        print(f"wrote {p} ({len(current)} builds, {nk} kernels)", file=out)
        return EXIT_OK
    if failures:
        print(f"FAIL: {len(failures)} kernel(s) grew beyond the thresholds; if intended, run "
              "`megabench gate --kernels --update` and commit reports/kernel_metrics.json", file=out)
        return EXIT_REGRESSION
    new = [r for r in rows if r["change"] == "new kernel"]
    if new:
        print(f"{len(new)} kernel(s) have no baseline yet (not a failure): record them with --update", file=out)
    return EXIT_OK
