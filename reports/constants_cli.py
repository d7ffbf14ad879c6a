"""`megabench constants show [--gpu G]`: every tuned constant from its measurement to the build.

For each constant of microbench/constants.py, one block of lines:

  measured  the newest result's value (re-derived with the current rule: microbench/rederive.py),
            with its result file; "none" where no result of its benchmark exists for the GPU
  tuned     the value of the current constants revision (reports/constants/<gpu>.json) and where
            it came from (measured, pinned, default)
  pinned    the pin's value and why it is pinned (reports/constants/pins/<gpu>.json), if any
  adopted   the value in the revision the build reads (reports/constants/adopted/<gpu>.json; a
            name the revision recorded under an older name is mapped through constants.RENAMED
            and says so)
  build     what the default build renders from the adopted revision (megakernel.plans.plan_for
            -> plan.make_plan, fill_ring included), per preset where the presets differ, or how
            the build uses the constant when it is not a plan field; "not read by the build" for
            the constants only the report and the model use

The build row plans for --sm SMs (default 132, the H200's); MEGABENCH_CONSTANTS does not change
what this shows (it reads the adoption, as a build without that variable does). Exit codes: 0
shown; 2 an unknown GPU (the message names the GPUs with a constants file) or a malformed file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from microbench.adopt import load_adopted, load_adoption
from microbench.constants import RENAMED, SPECS, constants_dir, gpu_slug
from microbench.errors import MegabenchError, ResultsFileError
from microbench.fmt import fmt
from microbench.pins import folder_of, load_pins
from microbench.results import REPO_ROOT, results_root
from microbench.tune import collect, load_constants

PRESETS = ("tiny", "small", "shard8")

# How a constant that feeds the build reaches it: (Plan field, how plan_for turns the adopted value
# into it). A constant whose field is None is used by the build outside the plan's fields.
BUILD_PATH: dict[str, tuple[str | None, str]] = {
    "ring_stages": ("ring_stages", "the tuned stages plus those fill_ring adds from spare shared memory"),
    "ring_stage_bytes": ("stage_bytes", "bytes a stage holds: the largest tile's, within the tuned budget"),
    "spin_bound_ns": ("spin_bound_ns", "the tuned bound plus plans.PHASE_ALLOWANCE_NS (a producer's phase)"),
    "poll_backoff_ns": ("poll_backoff_ns", "as tuned"),
    "evict_first_pays": ("stream_evict_first", "evict-first hint on streamed weights when it pays (1)"),
    "pdl_pays": ("pdl", "programmatic dependent launch between the step's launches when it pays (1)"),
    "sentinel_pays": ("sentinel_route", "sentinel slots for the router's logits when they pay (1)"),
    "max_code_bytes_per_launch": (None, "the code budget every build is checked against (plans.code_budget)"),
}


def known_gpus(directory: Path) -> list[str]:
    """The GPU models with a current constants file in `directory`."""
    out = []
    for p in sorted(directory.glob("*.json")):
        try:
            gpu = json.loads(p.read_text()).get("gpu")
        except (OSError, json.JSONDecodeError) as e:
            raise ResultsFileError(f"{p}: cannot read ({e})") from None
        if gpu:
            out.append(gpu)
    return out


def check_gpu(gpu: str, directory: Path) -> None:
    """Refuse a GPU without a constants file, naming the known ones."""
    known = known_gpus(directory)
    if gpu not in known:
        raise ResultsFileError(f"unknown GPU {gpu!r}: {directory} has constants for "
                               + (", ".join(repr(g) for g in known) if known else "no GPU")
                               + " (names as `megabench info` prints them)")


def _renamed_in(revision_file: Path) -> dict[str, str]:
    """{new name: old name} for the constants `revision_file` recorded under an older name."""
    try:
        consts = json.loads(revision_file.read_text()).get("constants") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsFileError(f"{revision_file}: cannot read ({e})") from None
    return {new: old for old, new in RENAMED.items() if old in consts and new not in consts}


def build_values(adopted, n_sm: int) -> dict[str, dict[str, object]]:
    """{constant: {preset: what the default build renders}} for the constants in BUILD_PATH whose
    Plan field exists, from plan_for with the adopted constants; "code budget" for the budget."""
    from megakernel.plans import code_budget, plan_for  # heavy: torch (megakernel.plan)

    plans = {p: plan_for(p, adopted, n_sm) for p in PRESETS}
    out: dict[str, dict[str, object]] = {}
    for name, (field, _) in BUILD_PATH.items():
        if field is not None and all(hasattr(pl, field) for pl in plans.values()):
            out[name] = {p: getattr(pl, field) for p, pl in plans.items()}
    out["max_code_bytes_per_launch"] = {p: code_budget(adopted) for p in PRESETS}
    return out


def show(gpu: str, results: Path | None = None, directory: Path | None = None, n_sm: int = 132) -> list[dict]:
    """One dict per constant (SPECS order): name, unit, feeds_build, measured (value, result_file),
    tuned (value, source, revision, file), pin (value, reason) or None, adopted (value, revision,
    file, recorded_as), build ({preset: value} or None) and build_how."""
    d = folder_of(directory)
    check_gpu(gpu, d)
    _, measured = collect(results or results_root(), gpu, pins=None)
    tuned = load_constants(d / f"{gpu_slug(gpu)}.json", gpu=gpu)
    pins = load_pins(gpu, d)
    rec = load_adoption(gpu, d)
    adopted = load_adopted(gpu, d) if rec is not None else None
    renamed = _renamed_in(d / rec["revision_file"]) if rec is not None else {}
    built = build_values(adopted if adopted is not None else tuned, n_sm)
    rows = []
    for s in SPECS:
        m = measured[s.name]
        pin = pins.get(s.name)
        field, how = BUILD_PATH.get(s.name, (None, "not read by the build"))
        rows.append({
            "name": s.name, "unit": s.unit, "feeds_build": s.feeds_build,
            "measured": {"value": m.value if m.source == "measured" else None,
                         "result_file": m.provenance.get("result_file"), "date": m.provenance.get("date"),
                         "why_none": m.provenance.get("reason")},
            "tuned": {"value": getattr(tuned, s.name), "source": tuned.provenance.get(s.name, {}).get("source"),
                      "revision": tuned.revision, "file": _rel(tuned.path)},
            "pin": {"value": pin.value, "reason": pin.reason, "since": pin.since} if pin else None,
            "adopted": ({"value": getattr(adopted, s.name), "revision": adopted.revision, "file": rec["revision_file"],
                         "recorded_as": renamed.get(s.name)} if adopted is not None else None),
            "build": built.get(s.name), "build_field": field if s.name in built else None,
            "build_how": how if s.name in built or field is None else
            f"{how} (this build has no Plan.{field}: not read)",
        })
    return rows


def value_text(value, unit: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return fmt(value, unit) if isinstance(value, (int, float)) else str(value)


def _rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def render(gpu: str, rows: list[dict], n_sm: int) -> str:
    """The rows as text, one block per constant."""
    out = [f"Constants for {gpu}: measured -> tuned -> pinned -> adopted -> what the default build renders "
           f"({n_sm} SMs)", ""]
    for r in rows:
        u = r["unit"]
        m, t, p, a = r["measured"], r["tuned"], r["pin"], r["adopted"]
        out.append(f"{r['name']} ({u or 'dimensionless'}){'  [feeds the build]' if r['feeds_build'] else ''}")
        out.append(f"  measured  {value_text(m['value'], u):>12}  " + (f"{m['result_file']} ({m['date']})" if m["value"] is not None
                                                             else f"none: {m['why_none']}"))
        out.append(f"  tuned     {value_text(t['value'], u):>12}  revision {t['revision']} ({t['source']}), {t['file']}")
        if p is not None:
            held = t["source"] == "pinned" and t["value"] == p["value"]
            out.append(f"  pinned    {value_text(p['value'], u):>12}  since {p['since'] or '?'}"
                       + ("" if held else f" (revision {t['revision']} does not hold it yet: the next `megabench "
                                          "tune` writes it)") + f": {p['reason']}")
        if a is not None:
            was = f", recorded as {a['recorded_as']!r} (constants.RENAMED)" if a["recorded_as"] else ""
            out.append(f"  adopted   {value_text(a['value'], u):>12}  revision {a['revision']} ({a['file']}{was})")
        else:
            out.append("  adopted   -             no adopted revision: the build reads the tuned file, with a warning")
        b = r["build"]
        if b is None:
            out.append(f"  build     -             {r['build_how']}")
        else:
            vals = {value_text(x, u) for x in b.values()}
            shown = next(iter(vals)) if len(vals) == 1 else ", ".join(f"{k} {value_text(x, u)}" for k, x in b.items())
            where = f"Plan.{r['build_field']}" if r["build_field"] else "build check"
            out.append(f"  build     {shown:>12}  {where}: {r['build_how']}")
        out.append("")
    return "\n".join(out)


def add_parser(sub) -> None:
    s = sub.add_parser("constants", help="the tuned constants from measurement to build (`constants show`)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cs = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    sh = cs.add_parser("show", help="each constant: measured, tuned, pinned, adopted, what the build renders",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sh.add_argument("--gpu", default="NVIDIA H200", help="GPU model (default %(default)s)")
    sh.add_argument("--sm", type=int, default=132, help="SMs the build row plans for (default 132, the H200's)")
    sh.add_argument("--results", type=Path, default=None,
                    help="results root (default $MEGABENCH_RESULTS or reports/results)")
    sh.add_argument("--constants", type=Path, default=None,
                    help="constants folder (default $MEGABENCH_CONSTANTS_DIR or reports/constants)")
    sh.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    sh.set_defaults(fn=_cmd)


def _cmd(args) -> int:
    d = args.constants or constants_dir()
    try:
        rows = show(args.gpu, args.results, d, args.sm)
    except MegabenchError as e:
        print(f"megabench constants show: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1, default=str) if args.json else render(args.gpu, rows, args.sm))
    return 0


