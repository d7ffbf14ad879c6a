"""Atomic output: a file a command writes appears whole or not at all, and a folder is built beside
its target and swapped in only once it is complete.

Every writer in megabench goes through here:
  write_bytes / write_text / write_json   one file: a temporary file in the same folder, flushed
                                          and synced, then renamed over the name (replace=True) or
                                          hard-linked to a name that must not exist yet (replace=False:
                                          results and constants revisions are never overwritten)
  open_atomic(path, mode)                 the same as a context manager, for writers that take a
                                          file object (json.dump, tarfile, ...)
  atomic_path(path)                       a temporary path with the same suffix, for writers that
                                          insist on a file name (matplotlib's savefig)
  build_dir(path)                         a temporary folder beside `path`; on success the old
                                          folder (if any) is renamed aside, the new one renamed in,
                                          and only then the old one removed
  check_writable(*paths)                  refuse, before any work, outputs whose folder is missing

On an exception inside the context the temporary file or folder is removed and the target is left
exactly as it was. A missing parent folder is an OutputError naming it unless `mkdir=True` (the
writer owns the folder, e.g. a results class folder); a user-given path with a typo in its folder
is refused instead of created. The rename is atomic within one file system (the temporary lives in
the target's own folder, so it always is).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputError

TMP_PREFIX = ".tmp-"  # readers skip names starting with it (results.find does)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _parent(path: Path, mkdir: bool) -> Path:
    d = path.parent
    if d.is_dir():
        return d
    if d.exists():
        raise OutputError(f"cannot write {path}: {d} is not a folder")
    if not mkdir:
        raise OutputError(f"cannot write {path}: folder {d} does not exist")
    d.mkdir(parents=True, exist_ok=True)
    return d


def check_writable(*paths: str | Path | None) -> None:
    """Raise OutputError naming the first output (None: not asked for) whose folder does not exist or
    that names a folder: called before the work so a typo costs nothing and writes nothing."""
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        if p.is_dir():
            raise OutputError(f"cannot write {p}: it is a folder")
        _parent(p, mkdir=False)


def _mode_for(path: Path, tmp: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777  # replacing a file keeps its permissions
    except FileNotFoundError:
        # what open() would have given a new file (mkstemp gives 0600), plus the execute bits a
        # writer that made its own file gave it (a linker's output)
        return (0o666 & ~_umask()) | (tmp.stat().st_mode & 0o111)


def _commit(tmp: Path, path: Path, replace: bool) -> None:
    if replace:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if the name exists: never overwrites
    except FileExistsError:
        raise OutputError(f"{path} exists already; not replacing it") from None
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | Path, *, replace: bool = True, mkdir: bool = False) -> Iterator[Path]:
    """A temporary path (same folder, same suffix) to write; renamed to `path` when the block ends
    without an exception, removed otherwise."""
    path = Path(path)
    d = _parent(path, mkdir)
    fd, name = tempfile.mkstemp(dir=d, prefix=TMP_PREFIX + path.stem + "-", suffix=path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if not tmp.is_file():
            raise OutputError(f"{path}: the writer left no file behind")
        os.chmod(tmp, _mode_for(path, tmp))
        _commit(tmp, path, replace)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def open_atomic(path: str | Path, mode: str = "w", *, replace: bool = True, mkdir: bool = False,
                durable: bool = True, encoding: str | None = "utf-8"):
    """open(path, mode) whose content appears at `path` only when the block ends cleanly."""
    if mode not in ("w", "wb"):
        raise ValueError(f"open_atomic: mode {mode!r}, expected 'w' or 'wb'")
    with atomic_path(path, replace=replace, mkdir=mkdir) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())


def write_bytes(path: str | Path, data: bytes, *, replace: bool = True, mkdir: bool = False,
                durable: bool = True) -> Path:
    with open_atomic(path, "wb", replace=replace, mkdir=mkdir, durable=durable) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str, *, replace: bool = True, mkdir: bool = False,
               durable: bool = True) -> Path:
    return write_bytes(path, text.encode(), replace=replace, mkdir=mkdir, durable=durable)


def write_json(path: str | Path, obj, *, indent: int | None = 1, replace: bool = True, mkdir: bool = False) -> Path:
    """JSON with a trailing newline; serialised before anything touches the disk (a value JSON cannot
    hold fails here, not half-way through the file)."""
    return write_text(path, json.dumps(obj, indent=indent) + "\n", replace=replace, mkdir=mkdir)


@contextmanager
def build_dir(path: str | Path, *, mkdir: bool = False) -> Iterator[Path]:
    """A fresh temporary folder beside `path` to fill; when the block ends cleanly it becomes `path`
    (an existing `path` is renamed aside first and removed once the new one is in place). On an
    exception the temporary folder is removed and `path` is untouched."""
    path = Path(path)
    d = _parent(path, mkdir)
    if path.exists() and not path.is_dir():
        raise OutputError(f"cannot build folder {path}: a file has that name")
    tmp = Path(tempfile.mkdtemp(dir=d, prefix=TMP_PREFIX + path.name + "-"))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=d, prefix=TMP_PREFIX + path.name + "-old-"))
            os.rmdir(old)
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)  # put the previous folder back
            raise
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
