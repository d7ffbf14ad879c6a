"""Does the %globaltimer tick change while a profiler is attached?

`tick_under_ncu()` (called by clocks.timers) runs this module as a child process under
`ncu --clock-control none`, profiling only the first clk_tick_probe launch (one pass, one
metric: seconds). The child runs the tick probe twice: once profiled, once with ncu still
attached but not profiling, and writes both to a JSON file. Without ncu on PATH, or when it
fails, the result says "not measured" and why; nothing is guessed.

    python -m microbench.clocks.ncu_tick OUT.json [--device N]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..atomic import write_json
from ..compiler import REPO_ROOT
from .probes import tick_probe

NCU_ARGS = ["--clock-control", "none", "--target-processes", "all", "-k", "regex:clk_tick_probe", "-c", "1",
            "--metrics", "gpu__time_duration.sum"]


def _child(out: str, device: int) -> int:
    first = tick_probe(device, blocks=4, max_changes=512)  # profiled by ncu (-c 1)
    second = tick_probe(device, blocks=4, max_changes=512)  # ncu attached, not profiling

    write_json(out, {"profiled": first.to_dict(), "attached_not_profiled": second.to_dict()}, indent=None)
    return 0


def tick_under_ncu(device: int = 0, timeout_s: float = 40.0) -> dict:
    """{"measured": bool, "why": str, "profiled": {...}, "attached_not_profiled": {...}, ...}."""
    if os.environ.get("MEGABENCH_NO_NCU", "0") not in ("", "0"):
        return {"measured": False, "why": "skipped: MEGABENCH_NO_NCU is set"}
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"measured": False, "why": "ncu is not on PATH"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "tick.json"
        cmd = [ncu, *NCU_ARGS, sys.executable, "-m", "microbench.clocks.ncu_tick", str(out), "--device", str(device)]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(REPO_ROOT))
        except subprocess.TimeoutExpired:
            return {"measured": False, "why": f"ncu run exceeded {timeout_s:.0f} s", "command": " ".join(cmd)}
        wall = time.perf_counter() - t0
        log = (p.stdout or "") + (p.stderr or "")
        errors = [ln for ln in log.splitlines() if "==ERROR==" in ln]
        profiled = sum(1 for ln in log.splitlines() if "==PROF== Profiling" in ln)
        base = {"command": " ".join(cmd), "rc": p.returncode, "wall_s": wall, "ncu_errors": errors[:5],
                "kernels_profiled": profiled}
        if p.returncode != 0 or not out.is_file():
            return {**base, "measured": False,
                    "why": f"ncu exited {p.returncode}; last output: {log.strip()[-600:]}"}
        data = json.loads(out.read_text())
        if errors or profiled < 1:
            return {**base, **data, "measured": False,
                    "why": f"ncu attached but did not profile the probe ({profiled} kernels profiled; "
                           f"errors: {errors[:2]})"}
        return {**base, **data, "measured": True, "why": "ncu --clock-control none profiled the first probe launch"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--device", type=int, default=0)
    a = ap.parse_args(argv)
    return _child(a.out, a.device)


if __name__ == "__main__":
    raise SystemExit(main())
