"""Host side of the in-kernel profiler (device side: microbench/cuda/mb/profile.cuh).

- ProfileEvents: a registry of named events (phases with begin/end, and instants). Ids are
  assigned here, in registration order, and rendered into a C header (or -D defines): kernels
  never carry magic numbers, and the reader names every record from the same registry.
- ProfileLayout / ProfileBuffer: the stamp buffer (one slice per launch), its kernel arguments
  (`args(launch)`), and reset between uses (an epoch bump makes old records recognisable).
- decode() -> Stamps: raw records, validated (header, contiguity, block/warp written where they
  belong, overflow). Anything inconsistent raises ProfileFormatError naming the record.
- Timeline: stamps on one clock (globaltimer ns, or clock64 mapped per SM onto globaltimer),
  begin/end matched into spans per (launch, block, warp), problems listed (never dropped
  silently), pandas views, Chrome/Perfetto trace-event export, a matplotlib plot.
- validate_trace(): the trace-event format rules the exporter must satisfy (checked in tests).

A registry's generated header names the command that regenerates it (`regenerate`; the clocks
benchmarks' headers: `python -m microbench.clocks.events`).
"""
from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_path, write_text
from ..errors import MegabenchError
from ..results import Series
from .calibrate import ClockCalibration, fit_clock_calibration

HEADER = Path(__file__).resolve().parent.parent / "cuda" / "mb" / "profile.cuh"


class ProfileFormatError(MegabenchError):
    """A stamp buffer, layout or event registry is inconsistent; the message names the record."""


class TraceFormatError(MegabenchError):
    """An exported trace breaks the Chrome/Perfetto trace-event format rules."""


@functools.lru_cache(maxsize=1)
def layout_constants() -> dict[str, int]:
    """The ProfLayout enum of profile.cuh (the only copy of the record/buffer layout)."""
    text = HEADER.read_text()
    body = text[text.index("enum ProfLayout"):]
    body = body[:body.index("};")]
    out = {m.group(1): int(m.group(2), 0) for m in re.finditer(r"PROF_([A-Z0-9_]+)\s*=\s*(0x[0-9A-Fa-f]+|\d+)u?", body)}
    need = {"MAGIC", "VERSION", "HEADER_BYTES", "RECORD_WORDS", "VALID", "TAG_WARP_SHIFT", "EVENT_MASK", "H_EPOCH",
            "META_BLOCKS_MASK", "META_WARPS_SHIFT", "META_WARPS_MASK", "META_CAP_SHIFT", "META_CAP_MASK",
            "META_EPOCH_SHIFT", "META_EPOCH_MASK", "W_TAG", "W_ARG", "W_GT_LO", "W_GT_HI", "W_CLK_LO", "W_CLK_HI",
            "W_SM", "W_EPOCH_BLOCK", "EPOCH_BLOCK_SHIFT", "BLOCK_LOW_MASK"}
    missing = need - set(out)
    if missing:
        raise RuntimeError(f"{HEADER}: ProfLayout enum lacks {sorted(missing)}")
    return out


# ====================================================================================== events
EVENT_KINDS = ("begin", "end", "instant")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_PREFIX = re.compile(r"^[A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class Event:
    id: int
    name: str  # full name: "<phase>_begin", "<phase>_end" or the instant's name
    kind: str  # begin | end | instant
    phase: str  # the phase a begin/end belongs to; the instant's own name for instants
    doc: str
    macro: str  # C macro carrying the id


class ProfileEvents:
    """Named profiler events of one kernel family, rendered into a header for the device.

    >>> ev = ProfileEvents("demo", prefix="DEMO_EV")
    >>> ev.phase("load", "stream weights into smem")
    (1, 2)
    >>> ev.instant("flag", "producer flag seen")
    3
    >>> ev.macro("load_begin")
    'DEMO_EV_LOAD_BEGIN'
    """

    def __init__(self, name: str, prefix: str, doc: str = "", regenerate: str = ""):
        if not _NAME.match(name):
            raise ProfileFormatError(f"event registry name {name!r}: use lower_snake_case")
        if not _PREFIX.match(prefix):
            raise ProfileFormatError(f"macro prefix {prefix!r}: use UPPER_SNAKE_CASE")
        self.name = name
        self.prefix = prefix
        self.doc = doc
        # the command the generated header names; "" for a registry whose header is only ever
        # generated at build time (tests, probes), never committed
        self.regenerate = regenerate
        self._events: list[Event] = []
        self._by_name: dict[str, Event] = {}

    # ---------------------------------------------------------------- registration
    def _add(self, name: str, kind: str, phase: str, doc: str) -> int:
        if name in self._by_name:
            raise ProfileFormatError(f"{self.name}: event {name!r} registered twice")
        eid = len(self._events) + 1  # 0 stays invalid: a zeroed record can never look like an event
        if eid > layout_constants()["EVENT_MASK"]:
            raise ProfileFormatError(f"{self.name}: more than {layout_constants()['EVENT_MASK']} events")
        ev = Event(eid, name, kind, phase, doc, f"{self.prefix}_{name.upper()}")
        self._events.append(ev)
        self._by_name[name] = ev
        return eid

    def phase(self, name: str, doc: str = "") -> tuple[int, int]:
        """Register a phase: events `<name>_begin` and `<name>_end`; returns their ids."""
        if not _NAME.match(name):
            raise ProfileFormatError(f"{self.name}: phase name {name!r}: use lower_snake_case")
        if name in self.phases or name in self._by_name:
            raise ProfileFormatError(f"{self.name}: {name!r} registered twice")
        return self._add(f"{name}_begin", "begin", name, doc), self._add(f"{name}_end", "end", name, doc)

    def instant(self, name: str, doc: str = "") -> int:
        """Register a point event; returns its id."""
        if not _NAME.match(name):
            raise ProfileFormatError(f"{self.name}: instant name {name!r}: use lower_snake_case")
        if name in self.phases:
            raise ProfileFormatError(f"{self.name}: {name!r} is already a phase")
        return self._add(name, "instant", name, doc)

    # ---------------------------------------------------------------- lookup
    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(self._events)

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.phase for e in self._events if e.kind != "instant"))

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, name: str) -> Event:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.name}: no event {name!r}; have {sorted(self._by_name)}") from None

    def id(self, name: str) -> int:
        return self[name].id

    def macro(self, name: str) -> str:
        return self[name].macro

    def by_id(self, eid: int) -> Event | None:
        return self._events[eid - 1] if 1 <= eid <= len(self._events) else None

    # ---------------------------------------------------------------- rendering
    def defines(self) -> dict[str, int]:
        """-D defines for compile_cuda (the same names the header defines)."""
        d = {e.macro: e.id for e in self._events}
        d[f"{self.prefix}_COUNT"] = len(self._events)
        return d

    def header_text(self) -> str:
        w = max([len(e.macro) for e in self._events] + [len(self.prefix) + len("_COUNT")]) + 1
        lines = [f"// Generated by microbench/clocks/profiler.py from ProfileEvents({self.name!r}); do not edit.",
                 *([f"// Regenerate: {self.regenerate}"] if self.regenerate else []),
                 f"// {self.doc}" if self.doc else "// Profiler event ids (mb/profile.cuh).",
                 "#pragma once", ""]
        for e in self._events:
            what = f"{e.kind} of phase {e.phase}" if e.kind != "instant" else "instant"
            lines.append(f"#define {e.macro:<{w}}{e.id}u  // {what}{': ' + e.doc if e.doc else ''}")
        lines += [f"#define {self.prefix + '_COUNT':<{w}}{len(self._events)}u", "",
                  f"static_assert({self.prefix}_COUNT <= 0xFFFFu, \"profiler event ids are 16 bits\");", ""]
        return "\n".join(lines)

    def write_header(self, path: str | Path) -> Path:
        return write_text(path, self.header_text(), mkdir=True)

    def check_header(self, path: str | Path) -> None:
        """Raise ProfileFormatError unless `path` holds exactly this registry's header."""
        p = Path(path)
        if not p.is_file():
            raise ProfileFormatError(f"{p}: generated event header missing; run {self.regenerate}")
        if p.read_text() != self.header_text():
            raise ProfileFormatError(f"{p} is stale (the registry {self.name!r} changed); run {self.regenerate}")


# ====================================================================================== layout
def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ProfileLayout:
    """Capacity of one launch's slice: `blocks` x `warps` warp slots x `cap` records each.

    Only lane 0 of warps 0..warps-1 of blocks 0..blocks-1 record; `for_launch` sizes it for a grid.
    """

    blocks: int
    warps: int = 1
    cap: int = 64

    def __post_init__(self):
        c = layout_constants()
        for what, v, hi in (("blocks", self.blocks, c["META_BLOCKS_MASK"]), ("warps", self.warps, 32),
                            ("cap", self.cap, c["META_CAP_MASK"])):
            if not isinstance(v, (int, np.integer)) or not 1 <= int(v) <= hi:
                raise ProfileFormatError(f"ProfileLayout.{what}={v!r}: must be an integer in [1, {hi}]")

    @classmethod
    def for_launch(cls, spec, *, warps: int | None = None, cap: int = 64) -> ProfileLayout:
        """Layout for a LaunchSpec: every block, `warps` warp slots (default: all warps of a block)."""
        w = warps if warps is not None else -(-spec.threads // 32)
        return cls(spec.blocks, w, cap)

    @property
    def record_bytes(self) -> int:
        return 4 * layout_constants()["RECORD_WORDS"]

    @property
    def overflow_bytes(self) -> int:
        return _align(4 * self.blocks * self.warps, 32)

    @property
    def records_offset(self) -> int:
        return layout_constants()["HEADER_BYTES"] + self.overflow_bytes

    @property
    def slice_bytes(self) -> int:
        return _align(self.records_offset + self.blocks * self.warps * self.cap * self.record_bytes, 256)

    def meta(self, epoch: int) -> int:
        c = layout_constants()
        if not 1 <= epoch <= c["META_EPOCH_MASK"]:
            raise ProfileFormatError(f"epoch {epoch} outside [1, {c['META_EPOCH_MASK']}]")
        return (self.blocks | self.warps << c["META_WARPS_SHIFT"] | self.cap << c["META_CAP_SHIFT"]
                | epoch << c["META_EPOCH_SHIFT"])

    @staticmethod
    def unpack_meta(meta: int) -> tuple[ProfileLayout, int]:
        c = layout_constants()
        meta = int(meta)
        lay = ProfileLayout(meta & c["META_BLOCKS_MASK"], (meta >> c["META_WARPS_SHIFT"]) & c["META_WARPS_MASK"],
                            (meta >> c["META_CAP_SHIFT"]) & c["META_CAP_MASK"])
        return lay, (meta >> c["META_EPOCH_SHIFT"]) & c["META_EPOCH_MASK"]

    def check_launch(self, spec) -> None:
        """Refuse a grid with more blocks than the layout records (they would record nothing)."""
        if spec.blocks > self.blocks:
            raise ProfileFormatError(f"launch has {spec.blocks} blocks but the profile layout holds {self.blocks}: "
                                     "the extra blocks would record nothing")

    def header_words(self, launch: int, epoch: int) -> np.ndarray:
        c = layout_constants()
        h = np.zeros(c["HEADER_BYTES"] // 4, dtype=np.uint32)
        h[:9] = [c["MAGIC"], c["VERSION"], self.blocks, self.warps, self.cap, self.record_bytes, launch, 0,
                 self.slice_bytes]
        h[c["H_EPOCH"]] = epoch
        return h


PROFILE_OFF = (0, np.uint64(0))  # kernel arguments that record nothing (a null buffer)


class ProfileBuffer:
    """Device buffer with one slice per launch. Pass `*buf.args(i)` as the kernel's MB_PROF_PARAMS.

    Call reset() between uses of the same slices: it bumps the epoch, so records of the previous
    use are recognised as stale instead of read as new. It enqueues nothing: a launch given
    args(i) zeroes slice i's overflow counters and writes its header epoch itself (profile.cuh).
    read() expects the slices handed out since the last reset to carry the new epoch and treats
    the others as not recorded.
    """

    def __init__(self, layout: ProfileLayout, launches: int = 1, device: int | str = 0):
        """device: a CUDA device index, or a torch device string ("cpu" for host-side tests)."""
        import torch  # heavy: torch

        if launches < 1:
            raise ProfileFormatError(f"launches={launches}: need at least one slice")
        self.layout = layout
        self.launches = int(launches)
        self.device = device
        self.epoch = 1
        self.armed: set[int] = set()  # slices handed out by args() since the last reset
        self._words = layout.slice_bytes // 4
        dev = device if isinstance(device, str) else f"cuda:{device}"
        self.tensor = torch.zeros(self.launches * self._words, dtype=torch.int32, device=dev)
        self._write_headers()

    @property
    def nbytes(self) -> int:
        return self.launches * self.layout.slice_bytes

    def _write_headers(self) -> None:
        """Every slice's header, once, when the buffer is made (later epochs: the device, profile.cuh)."""
        import torch  # heavy: torch

        heads = np.stack([self.layout.header_words(i, self.epoch) for i in range(self.launches)]).view(np.int32)
        hw = heads.shape[1]
        self.tensor.view(self.launches, self._words)[:, :hw].copy_(torch.from_numpy(heads))

    def ptr(self, launch: int = 0) -> int:
        if not 0 <= launch < self.launches:
            raise ProfileFormatError(f"launch slice {launch} out of range [0, {self.launches})")
        return self.tensor.data_ptr() + launch * self.layout.slice_bytes

    def args(self, launch: int = 0) -> tuple[int, np.uint64]:
        """(buffer pointer, meta) for MB_PROF_PARAMS of launch slice `launch`, which read() then
        expects to be recorded in this epoch."""
        p = self.ptr(launch)
        self.armed.add(int(launch))
        return p, np.uint64(self.layout.meta(self.epoch))

    def reset(self) -> None:
        """Start a new epoch (host only: the launches given args() reset their slices, profile.cuh).
        Danger: a kernel built without the profiler, given args(), writes nothing, and read()
        then refuses its slice as not recorded in this epoch."""
        c = layout_constants()
        self.epoch = self.epoch % c["META_EPOCH_MASK"] + 1
        self.armed = set()

    def raw(self) -> np.ndarray:
        """Host copy of the whole buffer as uint32 words (synchronises with the device)."""
        return self.tensor.cpu().numpy().view(np.uint32)

    def read(self, recorded: Iterable[int] | None = None) -> Stamps:
        """The stamps of this epoch. recorded: the slices expected to be recorded (default: those
        handed out by args() since the reset; () to check that a kernel built without the profiler
        wrote nothing: any record of this epoch would still be decoded, with its header)."""
        return decode(self.raw(), self.layout, self.launches, epoch=self.epoch,
                      recorded=self.armed if recorded is None else recorded)


# ====================================================================================== decoding
@dataclass(frozen=True)
class Stamps:
    """Every valid record of a buffer, ordered by (launch, block, warp, slot)."""

    layout: ProfileLayout
    launches: int
    epoch: int
    launch: np.ndarray
    block: np.ndarray
    warp: np.ndarray
    slot: np.ndarray
    event: np.ndarray
    arg: np.ndarray
    sm: np.ndarray
    gt: np.ndarray  # uint64 %globaltimer ns
    c64: np.ndarray  # uint64 %clock64 (0 when not recorded)
    overflow: np.ndarray  # (launches, blocks, warps): stamps that found the warp's records full
    stale: int = 0  # records of an earlier epoch left behind the valid ones (not errors)

    def __len__(self) -> int:
        return int(self.launch.size)

    @property
    def has_clock64(self) -> bool:
        return len(self) > 0 and bool(np.all(self.c64 != 0))

    def counts(self) -> np.ndarray:
        """(launches, blocks, warps) number of records written."""
        out = np.zeros((self.launches, self.layout.blocks, self.layout.warps), dtype=np.int64)
        np.add.at(out, (self.launch, self.block, self.warp), 1)
        return out

    def df(self, events: ProfileEvents | None = None):
        import pandas as pd  # heavy: pandas

        d = pd.DataFrame({"launch": self.launch, "block": self.block, "warp": self.warp, "slot": self.slot,
                          "sm": self.sm, "event": self.event, "arg": self.arg, "gt_ns": self.gt, "c64": self.c64})
        if events is not None:
            names = {e.id: e.name for e in events.events}
            d["name"] = [names.get(int(e), f"unknown_event_{int(e)}") for e in self.event]
        return d


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)


def decode(raw: np.ndarray, layout: ProfileLayout, launches: int = 1, epoch: int | None = None,
           recorded: Iterable[int] | None = None) -> Stamps:
    """Validate and decode a raw buffer (uint32 words, as from ProfileBuffer.raw()).

    epoch: the reader's epoch (default: each slice's own header). recorded: the slices a launch of this
    epoch was given (ProfileBuffer.args); any other slice whose header names an older epoch was not
    recorded and yields no records. Without it every slice must carry the epoch. A (block, warp)
    slot with no record of the epoch did not run, so its overflow counter is an older epoch's."""
    c = layout_constants()
    armed = None if recorded is None else {int(L) for L in recorded}
    words = np.ascontiguousarray(raw)
    if words.dtype.kind not in "iu":
        raise ProfileFormatError(f"raw profile buffer must be integer words, got dtype {words.dtype}")
    words = words.view(np.uint32).ravel()
    sw = layout.slice_bytes // 4
    if words.size < launches * sw:
        raise ProfileFormatError(f"buffer has {words.size} words; {launches} launch slices of this layout need "
                                 f"{launches * sw}")
    rw = c["RECORD_WORDS"]
    B, W, C = layout.blocks, layout.warps, layout.cap
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("launch", "block", "warp", "slot", "event", "arg", "sm",
                                                         "gt", "c64")}
    overflow = np.zeros((launches, B, W), dtype=np.int64)
    stale_total = 0
    epoch0 = None
    for L in range(launches):
        s = words[L * sw:(L + 1) * sw]
        h = s[: c["HEADER_BYTES"] // 4]
        he = int(h[c["H_EPOCH"]])
        expect = layout.header_words(L, he)
        if h[0] != c["MAGIC"]:
            raise ProfileFormatError(f"launch slice {L}: header magic 0x{int(h[0]):08x}, expected 0x{c['MAGIC']:08x} "
                                     "(not a profile buffer, or the slice was overwritten)")
        if not np.array_equal(h[:9], expect[:9]):
            raise ProfileFormatError(f"launch slice {L}: header {h[:9].tolist()} does not match the layout "
                                     f"{layout} (expected {expect[:9].tolist()} apart from the epoch)")
        ep = he if epoch is None else int(epoch)
        epoch0 = ep if epoch0 is None else epoch0
        if he != ep and (armed is None or L in armed):
            raise ProfileFormatError(f"launch slice {L}: header epoch {he}, reader expected {ep}"
                                     + (" (the slice was handed to a launch that did not record: a kernel built "
                                        "without the profiler, or a launch that never ran?)" if armed else ""))
        ovf = s[c["HEADER_BYTES"] // 4: c["HEADER_BYTES"] // 4 + B * W].astype(np.int64).reshape(B, W)
        off = layout.records_offset // 4
        rec = s[off: off + B * W * C * rw].reshape(B * W, C, rw)
        tag = rec[:, :, c["W_TAG"]]
        eb = rec[:, :, c["W_EPOCH_BLOCK"]]
        marked = (tag & np.uint32(c["VALID"])) != 0
        current = marked & ((eb >> np.uint32(c["EPOCH_BLOCK_SHIFT"])) == np.uint32(ep))
        if he != ep:  # not recorded in this epoch (checked above): every record is older
            current[:] = False
        n = current.sum(axis=1)
        ovf = np.where(n.reshape(B, W) > 0, ovf, 0)  # slots that did not run keep an older count
        prefix = np.arange(C)[None, :] < n[:, None]
        if not np.array_equal(current, prefix):
            row = int(np.argwhere(current != prefix)[0][0])
            b, w = divmod(row, W)
            raise ProfileFormatError(f"launch {L} block {b} warp {w}: records at slots "
                                     f"{np.flatnonzero(current[row]).tolist()[:16]} are not contiguous from slot 0 "
                                     "(a gap or a stray record): corrupted buffer")
        stale_total += int((marked & ~current).sum())
        slots = np.argwhere(current)  # (slot_row, index), row-major = (block, warp, slot) order
        r = rec[current]
        row = slots[:, 0]
        blk, wrp = row // W, row % W
        got_w = (r[:, c["W_TAG"]] >> np.uint32(c["TAG_WARP_SHIFT"])) & np.uint32(0x7FFF)
        got_b = r[:, c["W_EPOCH_BLOCK"]] & np.uint32(c["BLOCK_LOW_MASK"])
        if np.any(got_w != wrp) or np.any(got_b != (blk & c["BLOCK_LOW_MASK"])):
            i = int(np.argmax((got_w != wrp) | (got_b != (blk & c["BLOCK_LOW_MASK"]))))
            raise ProfileFormatError(f"launch {L}: record in the slot of block {int(blk[i])} warp {int(wrp[i])} says "
                                     f"block (low bits) {int(got_b[i])} warp {int(got_w[i])}: written out of place")
        full = n.reshape(B, W) == C
        if np.any((ovf > 0) & ~full):
            b, w = np.argwhere((ovf > 0) & ~full)[0]
            raise ProfileFormatError(f"launch {L} block {b} warp {w}: overflow counter {int(ovf[b, w])} but only "
                                     f"{int(n.reshape(B, W)[b, w])} of {C} records written (counters not reset?)")
        overflow[L] = ovf
        gt = r[:, c["W_GT_LO"]].astype(np.uint64) | (r[:, c["W_GT_HI"]].astype(np.uint64) << np.uint64(32))
        ck = r[:, c["W_CLK_LO"]].astype(np.uint64) | (r[:, c["W_CLK_HI"]].astype(np.uint64) << np.uint64(32))
        cols["launch"].append(np.full(len(r), L))
        cols["block"].append(blk)
        cols["warp"].append(wrp)
        cols["slot"].append(slots[:, 1])
        cols["event"].append(r[:, c["W_TAG"]] & np.uint32(c["EVENT_MASK"]))
        cols["arg"].append(r[:, c["W_ARG"]])
        cols["sm"].append(r[:, c["W_SM"]])
        cols["gt"].append(gt)
        cols["c64"].append(ck)
    ints = {k: _concat(v, np.int64) for k, v in cols.items() if k not in ("gt", "c64")}
    return Stamps(layout, launches, int(epoch0 or 0), ints["launch"], ints["block"],
                  ints["warp"], ints["slot"], ints["event"], ints["arg"], ints["sm"], _concat(cols["gt"], np.uint64),
                  _concat(cols["c64"], np.uint64), overflow, stale_total)


# ====================================================================================== timeline
@dataclass(frozen=True)
class Span:
    launch: int
    block: int
    warp: int
    sm: int
    phase: str
    arg: int
    begin_ns: float
    end_ns: float
    end_arg: int

    @property
    def dur_ns(self) -> float:
        return self.end_ns - self.begin_ns


@dataclass(frozen=True)
class Instant:
    launch: int
    block: int
    warp: int
    sm: int
    name: str
    arg: int
    t_ns: float


CLOCK_GLOBALTIMER = "globaltimer"
CLOCK_CLOCK64 = "clock64->globaltimer"


@dataclass(frozen=True)
class Timeline:
    """Stamps on one clock, with begin/end matched into spans.

    `t_ns[i]` is stamp i's time in ns after `origin_gt` (a %globaltimer value). `clock` says which
    timer produced it: "globaltimer" (as read) or "clock64->globaltimer" (each SM's cycle stamps
    mapped through `calibration`). `problems` lists everything that did not fit (unknown event
    ids, unmatched begin/end, time going backwards, overflow): nothing is dropped silently.
    """

    events: ProfileEvents
    stamps: Stamps
    t_ns: np.ndarray
    origin_gt: int
    clock: str
    spans: tuple[Span, ...]
    instants: tuple[Instant, ...]
    problems: tuple[str, ...]
    calibration: ClockCalibration | None = None
    launch_names: tuple[str, ...] | None = None

    @classmethod
    def build(cls, stamps: Stamps, events: ProfileEvents, *, clock: str | ClockCalibration = CLOCK_GLOBALTIMER,
              key_fields: Sequence[str] = ("sm",), ns_per_cycle: float | None = None, strict: bool = False,
              launch_names: Sequence[str] | None = None) -> Timeline:
        """clock: "globaltimer"; "clock64" (fit per-`key_fields` offsets and a shared rate, or
        `ns_per_cycle`, from the stamps' own (clock64, globaltimer) pairs); or a ClockCalibration
        fitted elsewhere (e.g. the skew benchmark). strict=True raises on any problem."""
        problems: list[str] = []
        n = len(stamps)
        origin = int(stamps.gt.min()) if n else 0
        gt_rel = (stamps.gt - np.uint64(origin)).astype(np.int64).astype(np.float64) if n else np.zeros(0)
        cal = None
        if isinstance(clock, ClockCalibration) or clock == "clock64":
            if n and not stamps.has_clock64:
                raise ProfileFormatError("clock64 timeline requested but the stamps carry no clock64 "
                                         "(compile with MB_PROF_CLOCK64=1)")
            fields = tuple(clock.key_fields) if isinstance(clock, ClockCalibration) else tuple(key_fields)
            keys = np.stack([getattr(stamps, f) for f in fields], axis=1) if n else np.zeros((0, len(fields)))
            if isinstance(clock, ClockCalibration):
                cal = clock
            elif n:
                cal = fit_clock_calibration(keys, stamps.c64, stamps.gt, key_fields=fields, ns_per_cycle=ns_per_cycle)
            t = cal.to_ns(keys, stamps.c64) + float(cal.origin_gt - origin) if n else np.zeros(0)
            clock_name = CLOCK_CLOCK64
        elif clock == CLOCK_GLOBALTIMER:
            t = gt_rel
            clock_name = CLOCK_GLOBALTIMER
        else:
            raise ProfileFormatError(f"clock={clock!r}: use 'globaltimer', 'clock64' or a ClockCalibration")
        # per (launch, block, warp) in slot order
        if n:
            same = ((stamps.launch[1:] == stamps.launch[:-1]) & (stamps.block[1:] == stamps.block[:-1])
                    & (stamps.warp[1:] == stamps.warp[:-1]))
            back = same & (stamps.gt[1:] < stamps.gt[:-1])
            if back.any():
                i = int(np.argmax(back)) + 1
                problems.append(f"globaltimer went backwards {int(back.sum())} times within a warp's stamps, first at "
                                f"launch {stamps.launch[i]} block {stamps.block[i]} warp {stamps.warp[i]} slot {stamps.slot[i]}")
        for L, b, w in np.argwhere(stamps.overflow > 0):
            problems.append(f"launch {L} block {b} warp {w}: {int(stamps.overflow[L, b, w])} stamps overflowed "
                            f"(capacity {stamps.layout.cap} per warp)")
        spans: list[Span] = []
        instants: list[Instant] = []
        stacks: dict[str, list[tuple[float, int]]] = {}
        cur = None
        lst = stamps.launch.tolist()
        bl = stamps.block.tolist()
        wl = stamps.warp.tolist()
        sml = stamps.sm.tolist()
        evl = stamps.event.tolist()
        argl = stamps.arg.tolist()
        tl = t.tolist()

        def close_group():
            if cur is None:
                return
            for ph, st in stacks.items():
                for (tb, _a) in st:
                    problems.append(f"launch {cur[0]} block {cur[1]} warp {cur[2]}: phase {ph!r} began at "
                                    f"{tb:.0f} ns and never ended")

        for i in range(n):
            g = (lst[i], bl[i], wl[i])
            if g != cur:
                close_group()
                cur = g
                stacks = {}
            ev = events.by_id(evl[i])
            if ev is None:
                problems.append(f"launch {g[0]} block {g[1]} warp {g[2]} slot {int(stamps.slot[i])}: unknown event id "
                                f"{evl[i]} (registry {events.name!r} has {len(events)})")
                instants.append(Instant(*g, sml[i], f"unknown_event_{evl[i]}", argl[i], tl[i]))
            elif ev.kind == "begin":
                stacks.setdefault(ev.phase, []).append((tl[i], argl[i]))
            elif ev.kind == "end":
                st = stacks.get(ev.phase)
                if not st:
                    problems.append(f"launch {g[0]} block {g[1]} warp {g[2]}: end of phase {ev.phase!r} at "
                                    f"{tl[i]:.0f} ns without a begin")
                    continue
                tb, a = st.pop()
                spans.append(Span(g[0], g[1], g[2], sml[i], ev.phase, a, tb, tl[i], argl[i]))
            else:
                instants.append(Instant(*g, sml[i], ev.name, argl[i], tl[i]))
        close_group()
        if strict and problems:
            raise ProfileFormatError(f"{len(problems)} profile problems; first: {problems[0]}")
        names = tuple(launch_names) if launch_names is not None else None
        if names is not None and len(names) != stamps.launches:
            raise ProfileFormatError(f"{len(names)} launch names for {stamps.launches} launches")
        return cls(events, stamps, np.asarray(t, dtype=np.float64), origin, clock_name, tuple(spans),
                   tuple(instants), tuple(problems), cal, names)

    # ---------------------------------------------------------------- queries
    def launch_name(self, launch: int) -> str:
        return self.launch_names[launch] if self.launch_names else f"launch {launch}"

    def first(self, name: str) -> dict[tuple[int, int, int], float]:
        """{(launch, block, warp): time of the first stamp of event `name`}."""
        eid = self.events.id(name)
        out: dict[tuple[int, int, int], float] = {}
        s = self.stamps
        for i in np.flatnonzero(s.event == eid):
            out.setdefault((int(s.launch[i]), int(s.block[i]), int(s.warp[i])), float(self.t_ns[i]))
        return out

    # ---------------------------------------------------------------- pandas views
    def stamps_df(self):
        d = self.stamps.df(self.events)
        d["kind"] = [(self.events.by_id(int(e)).kind if self.events.by_id(int(e)) else "unknown") for e in d["event"]]
        d["t_ns"] = self.t_ns
        return d

    def spans_df(self):
        import pandas as pd  # heavy: pandas

        cols = ["launch", "block", "warp", "sm", "phase", "arg", "begin_ns", "end_ns", "end_arg"]
        d = pd.DataFrame([[getattr(s, c) for c in cols] for s in self.spans], columns=cols)
        d["dur_ns"] = d["end_ns"] - d["begin_ns"]
        return d

    def instants_df(self):
        import pandas as pd  # heavy: pandas

        cols = ["launch", "block", "warp", "sm", "name", "arg", "t_ns"]
        return pd.DataFrame([[getattr(s, c) for c in cols] for s in self.instants], columns=cols)

    def phase_summary(self):
        """Per phase: count, duration percentiles (ns), first begin and last end."""
        d = self.spans_df()
        if d.empty:
            return d
        g = d.groupby("phase", sort=False)
        return g.agg(count=("dur_ns", "size"), dur_p10=("dur_ns", lambda x: float(np.percentile(x, 10))),
                     dur_p50=("dur_ns", "median"), dur_p90=("dur_ns", lambda x: float(np.percentile(x, 90))),
                     first_begin=("begin_ns", "min"), last_end=("end_ns", "max"))

    # ---------------------------------------------------------------- export
    def to_trace(self, *, by: str = "launch", style: str = "X", name: str | None = None) -> dict:
        return to_trace_events(self, by=by, style=style, name=name)

    def write_trace(self, path: str | Path, **kw) -> Path:
        obj = self.to_trace(**kw)
        check_trace(obj)

        return write_text(path, json.dumps(obj, allow_nan=False), mkdir=True)

    def plot(self, path: str | Path, **kw) -> Path:
        return plot_timeline(self, path, **kw)


# ====================================================================================== report series
def edge_series(tl: Timeline, *, launch: int | None = None, label=None, layer=None, prefix: str = "timeline",
                extra_params: Mapping[str, object] | None = None) -> list:
    """Spans as typed Series the report plots as a per-phase timeline (reports/megakernel.py's
    convention): one Series per (phase label, edge) with params phase, edge ("start"/"end"),
    optional layer; samples = per-span offsets in seconds from its launch's earliest stamp.

    label(span) -> str names the phase (default: span.phase); layer(span) -> int | None adds a
    layer param (spans are grouped by (label, layer)). launch: only that launch (default: all).
    """
    label = label or (lambda sp: sp.phase)
    first: dict[int, float] = {}
    for i in range(len(tl.stamps)):
        L = int(tl.stamps.launch[i])
        first[L] = min(first.get(L, math.inf), float(tl.t_ns[i]))
    groups: dict[tuple, dict[str, list[float]]] = {}
    order: dict[tuple, float] = {}
    for sp in tl.spans:
        if launch is not None and sp.launch != launch:
            continue
        key = (label(sp), layer(sp) if layer else None)
        g = groups.setdefault(key, {"start": [], "end": []})
        g["start"].append((sp.begin_ns - first[sp.launch]) * 1e-9)
        g["end"].append((sp.end_ns - first[sp.launch]) * 1e-9)
        order[key] = min(order.get(key, math.inf), sp.begin_ns)
    timer = "globaltimer" if tl.clock == CLOCK_GLOBALTIMER else "clock64"
    out = []
    for key in sorted(groups, key=lambda k: (order[k], str(k))):
        name, lay = key
        for edge in ("start", "end"):
            params = {"phase": name, "edge": edge, **({"layer": lay} if lay is not None else {}),
                      **dict(extra_params or {})}
            out.append(Series.from_samples(f"{prefix}/{name}{'' if lay is None else f'/L{lay}'}/{edge}",
                                           groups[key][edge], timer=timer, unit="s", params=params,
                                           metrics={"clock": tl.clock, "spans": len(groups[key][edge])}))
    return out


# ====================================================================================== trace events
def _lanes(spans: list[Span]) -> list[tuple[Span, int]]:
    """Assign each span of one track a lane so that spans within a lane nest properly (the
    trace-event format needs complete events on one thread to nest); overlapping-but-not-nested
    phases go to further lanes."""
    order = sorted(spans, key=lambda s: (s.begin_ns, -s.end_ns))
    stacks: list[list[float]] = []
    out = []
    for s in order:
        placed = None
        for li, st in enumerate(stacks):
            while st and st[-1] <= s.begin_ns:
                st.pop()
            if not st or s.end_ns <= st[-1]:
                st.append(s.end_ns)
                placed = li
                break
        if placed is None:
            stacks.append([s.end_ns])
            placed = len(stacks) - 1
        out.append((s, placed))
    return out


def to_trace_events(tl: Timeline, *, by: str = "launch", style: str = "X", name: str | None = None) -> dict:
    """Chrome/Perfetto trace-event JSON (object form). by="launch": one process per launch, one
    thread per (block, warp); by="sm": one process per SM, one thread per (launch, block, warp).
    style="X": complete events (ts + dur); "BE": begin/end pairs. ts in microseconds since the
    timeline origin; instants as ph "i" (thread scope)."""
    if by not in ("launch", "sm"):
        raise ValueError(f"by={by!r}: use 'launch' or 'sm'")
    if style not in ("X", "BE"):
        raise ValueError(f"style={style!r}: use 'X' or 'BE'")
    smof: dict[tuple[int, int, int], int] = {}
    for s in tl.spans:
        smof.setdefault((s.launch, s.block, s.warp), s.sm)
    for s in tl.instants:
        smof.setdefault((s.launch, s.block, s.warp), s.sm)

    def pid_of(k):
        return k[0] if by == "launch" else smof[k]

    per_track: dict[tuple[int, int, int], list[Span]] = {}
    for s in tl.spans:
        per_track.setdefault((s.launch, s.block, s.warp), []).append(s)
    inst_track: dict[tuple[int, int, int], list[Instant]] = {}
    for s in tl.instants:
        inst_track.setdefault((s.launch, s.block, s.warp), []).append(s)
    keys = sorted(set(per_track) | set(inst_track), key=lambda k: (pid_of(k), k))
    meta: list[dict] = []
    body: list[dict] = []
    next_tid: dict[int, int] = {}
    seen_pid: set[int] = set()

    def us(ns: float) -> float:
        return ns / 1e3

    for k in keys:
        L, b, w = k
        sm = smof[k]
        pid = pid_of(k)
        if pid not in seen_pid:
            seen_pid.add(pid)
            pname = tl.launch_name(L) if by == "launch" else f"SM {sm}"
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": pname}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        lanes = _lanes(per_track.get(k, []))
        nl = max([ln for _, ln in lanes], default=0) + 1
        for lane in range(nl):
            tid = next_tid.get(pid, 0)
            next_tid[pid] = tid + 1
            base = f"block {b} warp {w} (SM {sm})" if by == "launch" else f"{tl.launch_name(L)} block {b} warp {w}"
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"name": base + (f" [overlap {lane}]" if lane else "")}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
            mine = [s for s, ln in lanes if ln == lane]  # sorted by (begin, -end)
            evs: list[tuple[float, int, dict]] = []  # (ts_ns, order, event)
            if style == "X":
                for j, s in enumerate(mine):
                    evs.append((s.begin_ns, j, {"name": s.phase, "cat": "phase", "ph": "X", "ts": us(s.begin_ns),
                                                "dur": us(s.end_ns) - us(s.begin_ns), "pid": pid, "tid": tid,
                                                "args": {"arg": s.arg, "end_arg": s.end_arg, "launch": L, "block": b,
                                                         "warp": w, "sm": sm}}))
            else:
                stack: list[Span] = []
                j = 0

                def emit_end(sp):
                    nonlocal j
                    evs.append((sp.end_ns, j, {"name": sp.phase, "cat": "phase", "ph": "E", "ts": us(sp.end_ns),
                                               "pid": pid, "tid": tid, "args": {"end_arg": sp.end_arg}}))
                    j += 1

                for s in mine:
                    while stack and stack[-1].end_ns <= s.begin_ns:
                        emit_end(stack.pop())
                    evs.append((s.begin_ns, j, {"name": s.phase, "cat": "phase", "ph": "B", "ts": us(s.begin_ns),
                                                "pid": pid, "tid": tid,
                                                "args": {"arg": s.arg, "launch": L, "block": b, "warp": w, "sm": sm}}))
                    j += 1
                    stack.append(s)
                while stack:
                    emit_end(stack.pop())
            if lane == 0:
                for q, s in enumerate(sorted(inst_track.get(k, []), key=lambda x: x.t_ns)):
                    evs.append((s.t_ns, q, {"name": s.name, "cat": "instant", "ph": "i", "s": "t",
                                                     "ts": us(s.t_ns), "pid": pid, "tid": tid,
                                                     "args": {"arg": s.arg, "launch": L, "block": b, "warp": w,
                                                              "sm": sm}}))
            # stable by time; ties keep emission order (parents before children, E before B)
            evs.sort(key=lambda e: (e[2]["ts"], 1 if e[2]["ph"] == "i" else 0, e[1]))
            body += [e for _, _, e in evs]
    return {"traceEvents": meta + body, "displayTimeUnit": "ns",
            "otherData": {"generator": "megabench microbench/clocks/profiler.py", "name": name or tl.events.name,
                          "clock": tl.clock, "origin_globaltimer_ns": str(tl.origin_gt),
                          "problems": list(tl.problems[:100]), "problem_count": len(tl.problems)}}


_PH_NEEDS_TS = {"X", "B", "E", "i", "I"}
_PH_KNOWN = {"X", "B", "E", "i", "I", "M"}
_META_NAMES = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
               "thread_sort_index": "sort_index", "process_labels": "labels"}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_trace(obj) -> list[str]:
    """Errors against the trace-event format (JSON object form) as this project uses it:
    required keys and types per phase type, ts non-decreasing per (pid, tid) track, B/E
    matched per track, X events nested per track, JSON-serialisable without NaN."""
    errs: list[str] = []
    if not isinstance(obj, Mapping):
        return ["top level must be a JSON object with a traceEvents array"]
    evs = obj.get("traceEvents")
    if not isinstance(evs, list):
        return ["'traceEvents' missing or not an array"]
    if "displayTimeUnit" in obj and obj["displayTimeUnit"] not in ("ms", "ns"):
        errs.append(f"displayTimeUnit {obj['displayTimeUnit']!r} must be 'ms' or 'ns'")
    try:
        json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as e:
        errs.append(f"not serialisable as strict JSON: {e}")
    last_ts: dict[tuple, float] = {}
    open_b: dict[tuple, list[tuple[str, float]]] = {}
    open_x: dict[tuple, list[float]] = {}
    for i, e in enumerate(evs):
        where = f"event {i}"
        if not isinstance(e, Mapping):
            errs.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if not isinstance(ph, str) or ph not in _PH_KNOWN:
            errs.append(f"{where}: ph {ph!r} not one of {sorted(_PH_KNOWN)}")
            continue
        where = f"event {i} (ph {ph}, name {e.get('name')!r})"
        if ph != "E" and not isinstance(e.get("name"), str):
            errs.append(f"{where}: 'name' must be a string")
        if ph == "E" and "name" in e and not isinstance(e["name"], str):
            errs.append(f"{where}: 'name' must be a string when present")
        if "cat" in e and not isinstance(e["cat"], str):
            errs.append(f"{where}: 'cat' must be a string")
        if "args" in e and not isinstance(e["args"], Mapping):
            errs.append(f"{where}: 'args' must be an object")
        if not _is_int(e.get("pid")):
            errs.append(f"{where}: 'pid' must be an integer")
            continue
        if ph == "M":
            nm = e.get("name")
            if nm not in _META_NAMES:
                errs.append(f"{where}: unknown metadata name {nm!r}")
                continue
            if nm.startswith("thread") and not _is_int(e.get("tid")):
                errs.append(f"{where}: thread metadata needs an integer 'tid'")
            a = e.get("args")
            if not isinstance(a, Mapping) or _META_NAMES[nm] not in a:
                errs.append(f"{where}: args must carry {_META_NAMES[nm]!r}")
            elif nm.endswith("_name") and not isinstance(a["name"], str):
                errs.append(f"{where}: args.name must be a string")
            elif nm.endswith("sort_index") and not _is_int(a["sort_index"]):
                errs.append(f"{where}: args.sort_index must be an integer")
            continue
        if not _is_int(e.get("tid")):
            errs.append(f"{where}: 'tid' must be an integer")
            continue
        ts = e.get("ts")
        if not _is_num(ts):
            errs.append(f"{where}: 'ts' must be a finite number (microseconds)")
            continue
        track = (e["pid"], e["tid"])
        if ts < last_ts.get(track, -math.inf):
            errs.append(f"{where}: ts {ts} goes back in time on track pid={track[0]} tid={track[1]} "
                        f"(previous {last_ts[track]})")
        last_ts[track] = max(ts, last_ts.get(track, -math.inf))
        eps = 1e-9 * max(1.0, abs(ts))
        if ph in ("i", "I") and "s" in e and e["s"] not in ("g", "p", "t"):
            errs.append(f"{where}: instant scope 's' must be 'g', 'p' or 't'")
        if ph == "B":
            open_b.setdefault(track, []).append((e["name"], ts))
        elif ph == "E":
            st = open_b.get(track)
            if not st:
                errs.append(f"{where}: E without a matching B on track {track}")
            else:
                nm, tb = st.pop()
                if "name" in e and e["name"] != nm:
                    errs.append(f"{where}: E named {e['name']!r} closes B named {nm!r} (not nested)")
                if ts + eps < tb:
                    errs.append(f"{where}: E before its B")
        elif ph == "X":
            dur = e.get("dur")
            if not _is_num(dur) or dur < 0:
                errs.append(f"{where}: X needs a finite 'dur' >= 0")
                continue
            st = open_x.setdefault(track, [])
            while st and st[-1] <= ts + eps:
                st.pop()
            end = ts + dur
            if st and end > st[-1] + 1e-9 * max(1.0, abs(end)):
                errs.append(f"{where}: X [{ts}, {end}] overlaps the enclosing X ending at {st[-1]} without nesting "
                            f"(track {track})")
            st.append(end)
    for track, st in open_b.items():
        for nm, tb in st:
            errs.append(f"B {nm!r} at {tb} on track {track} never ends")
    return errs


def check_trace(obj) -> None:
    errs = validate_trace(obj)
    if errs:
        raise TraceFormatError(f"{len(errs)} trace-event format errors; first: " + "; ".join(errs[:5]))


# ====================================================================================== plot
def _x_range(spans, insts) -> tuple[float, float]:
    """The plot's x limits (us since the origin): what is drawn, with a 2% margin. The origin is
    the earliest stamp of every launch, so a plot of a later launch alone started at 0 and was
    mostly empty (the megakernel's middle launches of a step)."""
    xs = [s.begin_ns / 1e3 for s in spans] + [s.t_ns / 1e3 for s in insts]
    xe = [(s.begin_ns + max(s.dur_ns, 1.0)) / 1e3 for s in spans] + [s.t_ns / 1e3 for s in insts]
    if not xs:
        return 0.0, 1.0
    lo, hi = min(xs), max(xe)
    pad = 0.02 * (hi - lo) + 1e-3
    return lo - pad, hi + pad


def plot_timeline(tl: Timeline, path: str | Path, *, by: str = "sm", title: str | None = None,
                  max_rows: int = 160, launches: Iterable[int] | None = None) -> Path:
    """PNG of the spans: one row per SM (by="sm") or per launch/block (by="block"), x in
    microseconds since the origin, colour per phase; instants as ticks."""
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    if by not in ("sm", "block"):
        raise ValueError(f"by={by!r}: use 'sm' or 'block'")
    keep = set(launches) if launches is not None else None
    spans = [s for s in tl.spans if keep is None or s.launch in keep]
    insts = [s for s in tl.instants if keep is None or s.launch in keep]

    def row_key(s):
        return s.sm if by == "sm" else (s.launch, s.block)

    rows = sorted({row_key(s) for s in spans} | {row_key(s) for s in insts})
    note = ""
    if len(rows) > max_rows:
        step = -(-len(rows) // max_rows)
        rows = rows[::step]
        note = f" (every {step}th row of {len(rows) * step})"
    ypos = {r: i for i, r in enumerate(rows)}
    phases = list(tl.events.phases)
    cmap = plt.get_cmap("tab10" if len(phases) <= 10 else "tab20")
    fig_h = min(14.0, 2.0 + 0.06 * len(rows))
    fig, ax = plt.subplots(figsize=(12, fig_h))
    from matplotlib.collections import PolyCollection  # heavy: matplotlib
    from matplotlib.patches import Patch  # heavy: matplotlib

    handles = []
    for pi, ph in enumerate(phases):
        mine = [s for s in spans if s.phase == ph and row_key(s) in ypos]
        if not mine:
            continue
        y = np.array([ypos[row_key(s)] for s in mine], dtype=np.float64)
        x0 = np.array([s.begin_ns for s in mine]) / 1e3
        x1 = x0 + np.maximum(np.array([s.dur_ns for s in mine]) / 1e3, 1e-3)
        even = np.array([s.launch % 2 == 0 for s in mine])
        color = cmap(pi % cmap.N)
        # one collection per phase and launch parity (consecutive launches on an SM stay distinguishable)
        for sel, alpha in ((even, 0.95), (~even, 0.55)):
            if sel.any():
                verts = np.stack([np.stack([x0[sel], y[sel] - 0.4], 1), np.stack([x0[sel], y[sel] + 0.4], 1),
                                  np.stack([x1[sel], y[sel] + 0.4], 1), np.stack([x1[sel], y[sel] - 0.4], 1)], 1)
                ax.add_collection(PolyCollection(verts, facecolors=[color], alpha=alpha, linewidths=0))
        handles.append(Patch(color=color, label=ph))
    ax.set_xlim(*_x_range(spans, insts))
    ax.set_ylim(-1, max(len(rows), 1))
    if insts:
        m = [s for s in insts if row_key(s) in ypos]
        if m:
            handles.append(ax.scatter([s.t_ns / 1e3 for s in m], [ypos[row_key(s)] for s in m], marker="|", s=30,
                                      c="k", label="instants", linewidths=0.8))
    ax.set_xlabel(f"time since origin (us, {tl.clock})")
    ax.set_ylabel("SM" if by == "sm" else "launch / block")
    if len(rows) <= 40:
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([str(r) for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_title((title or f"{tl.events.name} timeline") + note, fontsize=10)
    if handles:
        ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=2)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()

    p = Path(path)
    try:
        with atomic_path(p, mkdir=True) as tmp:
            fig.savefig(tmp, dpi=120, format=p.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return p
