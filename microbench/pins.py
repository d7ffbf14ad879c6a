"""Pinned constants: reports/constants/pins/<gpu-slug>.json holds a constant at a stated value in
every new revision, with the reason (a rule that flips between runs of the same GPU, whose flip
would change the build). `megabench tune` applies them: the revision records `source: "pinned"`,
the pinned value, the reason, and what the latest result measured beside it.

Invariant: a pin names a known constant (microbench/constants.py), states a reason, and holds a
whole number for an integer constant; anything else is refused by name, never dropped.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from .constants import BY_NAME, constants_dir, gpu_slug
from .errors import ResultsFileError
from .results import read_json

PINS_SCHEMA = "megabench.constants_pins"
VERSION = 1  # the newest version of the pins and adoption documents this code reads


def folder_of(directory) -> Path:
    """The constants folder: `directory`, else constants_dir()."""
    return Path(directory) if directory else constants_dir()


def read_document(p: Path, schema: str) -> dict:
    """A constants-folder document (pins, adoption) of `schema`, refused by name when it is another
    document or a newer version than this code reads."""
    d = read_json(p)
    if not isinstance(d, dict) or d.get("schema") != schema:
        raise ResultsFileError(f"{p}: schema {d.get('schema') if isinstance(d, dict) else None!r}, expected {schema!r}")
    v = d.get("version")
    if not isinstance(v, int) or v > VERSION:
        raise ResultsFileError(f"{p}: version {v!r}, this reads up to {VERSION}")
    return d


@dataclasses.dataclass(frozen=True)
class Pin:
    name: str
    value: float | int
    reason: str
    since: str
    evidence: tuple[str, ...] = ()


def pins_path(gpu: str | None, directory=None) -> Path:
    return folder_of(directory) / "pins" / f"{gpu_slug(gpu)}.json"


def load_pins(gpu: str | None, directory=None) -> dict[str, Pin]:
    """{constant name: Pin} for `gpu` ({} without a pins file). A pin of an unknown constant, a
    pin without a reason, a non-integer pin of an integer constant are refused by name."""
    p = pins_path(gpu, directory)
    if gpu is None or not p.exists():
        return {}
    d = read_document(p, PINS_SCHEMA)
    if d.get("gpu") != gpu:
        raise ResultsFileError(f"{p}: pins for {d.get('gpu')!r}, not {gpu!r}")
    out = {}
    for name, e in (d.get("pins") or {}).items():
        spec = BY_NAME.get(name)
        if spec is None:
            raise ResultsFileError(f"{p}: pin of unknown constant {name!r} (microbench/constants.py)")
        if not isinstance(e, dict) or not str(e.get("reason", "")).strip():
            raise ResultsFileError(f"{p}: pin of {name} states no reason; a pinned constant must say why")
        v = e.get("value")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (spec.integer and v != int(v)):
            raise ResultsFileError(f"{p}: pin of {name}: value {v!r} is not a {'whole ' if spec.integer else ''}number")
        out[name] = Pin(name, int(v) if spec.integer else float(v), str(e["reason"]), str(e.get("since", "")),
                        tuple(e.get("evidence", ())))
    return out


def pinned_entries(gpu: str | None, measured: Mapping, directory=None, pins: Mapping | None = None) -> dict:
    """For tune: {name: (value, provenance)} of the pinned constants, each provenance naming the
    pin's reason and what the latest result measured (from `measured`: name -> tune Entry)."""
    pins = load_pins(gpu, directory) if pins is None else pins
    out = {}
    for name, pin in pins.items():
        m = measured.get(name)
        mp = dict(m.provenance) if m is not None else {}
        prov = {"benchmark": BY_NAME[name].benchmark, "derived_key": BY_NAME[name].derived_key,
                "result_file": mp.get("result_file"), "date": mp.get("date") or pin.since, "gpu": gpu,
                "gpu_key": mp.get("gpu_key"), "git_sha": mp.get("git_sha") or "pinned",
                "rule": f"PINNED: {pin.reason}", "spread": [pin.value, pin.value],
                "pinned_since": pin.since, "pin_evidence": list(pin.evidence),
                "pins_file": str(pins_path(gpu, directory)),
                "measured_value": m.value if m is not None else None,
                "measured_source": m.source if m is not None else None,
                "measured_rule": mp.get("rule"), "measured_spread": mp.get("spread")}
        out[name] = (pin.value, prov)
    return out
