"""Compile CUDA C++ (NVRTC) and raw PTX (nvJitLink) to cubins, with an on-disk cache.

Works without a GPU: every compile passes an explicit `arch`, so nothing asks the driver. The
cache key covers the source, every project header it can include, every define, the arch, every
option and the compiler versions; the file name stays readable (`<name>-<arch>-<hash>.cubin`).
Kernels must be `extern "C"` so their names survive caching (no mangled-name mapping to keep).

$MEGABENCH_INJECT_PPM (the regression gate's quality measurement only, microbench/gate_quality.py)
adds the define MB_INJECT_PPM to every compile: kernels that declare MB_INJECT_SCOPE()
(mb/inject.cuh) then spin that many ppm of each launch's time. The define is part of the key.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import write_bytes
from .cubin import ResourceUsage, parse_ptxas_log, resource_usage, text_sizes
from .errors import CompileError, KernelDoesNotFitError
from .launch import ensure_context

REPO_ROOT = Path(__file__).resolve().parent.parent
# Project header folders: always on the include path and hashed into the cache key.
PROJECT_INCLUDE_DIRS = (REPO_ROOT / "microbench" / "cuda", REPO_ROOT / "megakernel" / "csrc")
DEFAULT_ARCH = "sm_90a"
CACHE_FORMAT = 1
INJECT_ENV = "MEGABENCH_INJECT_PPM"  # the gate's build switch (mb/inject.cuh); unset in every normal build


def inject_ppm() -> int:
    """$MEGABENCH_INJECT_PPM as an integer number of parts per million (0 when unset)."""
    v = os.environ.get(INJECT_ENV, "").strip()
    if not v:
        return 0
    try:
        n = int(v)
    except ValueError:
        raise CompileError(f"{INJECT_ENV}={v!r}: want an integer number of parts per million (50000 = 5%)") from None
    if not 0 <= n <= 1_000_000:
        raise CompileError(f"{INJECT_ENV}={n}: want 0..1000000 ppm")
    return n


def cache_dir() -> Path:
    d = Path(os.environ.get("MEGABENCH_CACHE", Path.home() / ".cache" / "megabench" / "kernels"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.lru_cache(maxsize=1)
def toolchain_versions() -> dict[str, str]:
    out = {}
    try:
        from cuda.bindings import nvrtc  # heavy: cuda

        _, major, minor = nvrtc.nvrtcVersion()
        out["nvrtc"] = f"{major}.{minor}"
    except Exception as e:  # pragma: no cover - only without cuda-bindings
        out["nvrtc"] = f"unavailable ({e.__class__.__name__})"
    try:
        import cuda.core  # heavy: cuda

        out["cuda-core"] = cuda.core.__version__
    except Exception:
        out["cuda-core"] = "unavailable"
    try:
        import cuda.bindings  # heavy: cuda

        out["cuda-bindings"] = cuda.bindings.__version__
    except Exception:
        out["cuda-bindings"] = "unavailable"
    return out


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """CUDA toolkit headers (cuda_bf16.h, ...) and CCCL (cooperative groups, cuda::std)."""
    dirs: list[str] = []
    try:
        import cuda.pathfinder as pf  # heavy: cuda

        for lib in ("cudart", "cccl"):
            try:
                d = pf.find_nvidia_header_directory(lib)
                if d:
                    dirs.append(str(d))
            except Exception:
                pass
    except Exception:
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            for sub in ("include", "include/cccl"):
                p = Path(home) / sub
                if p.is_dir() and str(p) not in dirs:
                    dirs.append(str(p))
    return tuple(dict.fromkeys(dirs))


def _project_header_digest(extra_dirs: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for d in [*PROJECT_INCLUDE_DIRS, *extra_dirs]:
        d = Path(d)
        if not d.is_dir():
            continue
        for p in sorted(d.rglob("*")):
            if p.suffix in (".cuh", ".h", ".hpp", ".inc") and p.is_file():
                h.update(str(p.relative_to(d)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


@dataclass
class CompiledModule:
    """A cubin plus what it costs. `kernel(name)` loads it on the current GPU (lazily)."""

    name: str
    arch: str
    cubin: bytes
    log: str
    defines: dict[str, str]
    key: str
    path: Path | None
    resources: dict[str, ResourceUsage]
    _loaded: object = field(default=None, repr=False)
    _kernels: dict = field(default_factory=dict, repr=False)

    @property
    def code_bytes(self) -> dict[str, int]:
        """Machine-code bytes per function (kernels and non-inlined device functions)."""
        return text_sizes(self.cubin)

    def usage(self, kernel: str) -> ResourceUsage:
        try:
            return self.resources[kernel]
        except KeyError:
            raise KeyError(f"{self.name}: no kernel {kernel!r}; have {sorted(self.resources)}") from None

    def check_limits(self, kernel: str, *, max_spill_bytes: int = 0, max_registers: int | None = None,
                     max_code_bytes: int | None = None) -> ResourceUsage:
        """Refuse (KernelDoesNotFitError) a kernel that spills or is bigger than a budget."""
        u = self.usage(kernel)
        problems = []
        if u.spills > max_spill_bytes:
            problems.append(f"spills {u.spill_store_bytes} B stores / {u.spill_load_bytes} B loads "
                            f"(allowed {max_spill_bytes})")
        if max_registers is not None and u.registers > max_registers:
            problems.append(f"uses {u.registers} registers (budget {max_registers})")
        if max_code_bytes is not None and u.code_bytes > max_code_bytes:
            problems.append(f"is {u.code_bytes} B of machine code (budget {max_code_bytes})")
        if problems:
            raise KernelDoesNotFitError(f"kernel {kernel} in {self.name} ({self.arch}) " + "; ".join(problems))
        return u

    def kernel(self, kname: str):
        """cuda.core Kernel for `kname` on the current device (needs a GPU)."""
        if kname not in self._kernels:
            ensure_context()
            if self._loaded is None:
                from cuda.core import ObjectCode  # heavy: cuda

                self._loaded = ObjectCode.from_cubin(self.cubin, name=self.name)
            self._kernels[kname] = self._loaded.get_kernel(kname)
        return self._kernels[kname]


def _normalise_defines(defines: Mapping[str, object] | None) -> dict[str, str]:
    out = {}
    for k, v in (defines or {}).items():
        if not str(k).isidentifier():
            raise CompileError(f"define name {k!r} is not a C identifier")
        if isinstance(v, bool):
            v = int(v)
        out[str(k)] = str(v)
    return dict(sorted(out.items()))


def compile_cuda(source: str | Path, *, name: str | None = None, arch: str = DEFAULT_ARCH,
                 defines: Mapping[str, object] | None = None, include_dirs: Iterable[str | Path] = (),
                 lineinfo: bool = True, max_registers: int | None = None,
                 extra_options: Mapping[str, object] | None = None, use_cache: bool = True) -> CompiledModule:
    """NVRTC: CUDA C++ -> cubin for `arch`. `source` is a path to a .cu file or the text itself."""
    src_path = None
    if isinstance(source, Path) or (isinstance(source, str) and source.endswith(".cu") and "\n" not in source):
        src_path = Path(source)
        if not src_path.is_file():
            raise CompileError(f"CUDA source {src_path} does not exist")
        text = src_path.read_text()
        name = name or src_path.stem
    else:
        text = str(source)
        name = name or "inline"
    ppm = inject_ppm()
    defs = _normalise_defines({**({"MB_INJECT_PPM": ppm} if ppm else {}), **dict(defines or {})})
    incs = [str(Path(d)) for d in include_dirs]
    if src_path is not None:
        incs.insert(0, str(src_path.parent))
    toolkit = list(cuda_include_dirs())
    incs += [str(d) for d in PROJECT_INCLUDE_DIRS] + toolkit
    incs = list(dict.fromkeys(incs))
    opts = dict(extra_options or {})
    # The key names content, not locations: the headers of every include dir but the toolkit's by
    # their bytes, toolkit headers by the NVRTC version that ships them, so a cache built on one
    # machine is valid on another. Danger: a dir left out of the hash makes two kernel trees with the
    # same top-level text share one cubin (an A/B variant tree built as another tree's cubin).
    tv = toolchain_versions()
    key_material = json.dumps({
        "fmt": CACHE_FORMAT, "src": text, "name": name, "arch": arch, "defines": defs,
        "lineinfo": lineinfo, "maxreg": max_registers, "opts": {k: repr(v) for k, v in sorted(opts.items())},
        "headers": _project_header_digest([Path(i) for i in incs if i not in toolkit]),
        "tool": {"nvrtc": tv.get("nvrtc"), "cuda-core": tv.get("cuda-core")},
    }, sort_keys=True).encode()
    key = hashlib.sha256(key_material).hexdigest()[:20]
    base = cache_dir() / f"{name}-{arch}-{key}"
    cubin_p, meta_p = base.with_suffix(".cubin"), base.with_suffix(".json")
    if use_cache and cubin_p.is_file() and meta_p.is_file():
        try:
            meta = json.loads(meta_p.read_text())
            image = cubin_p.read_bytes()
            if "report" not in meta and _report_missing(image, meta["log"]):
                raise ValueError("no ptxas report")  # written before the fallback below: recompile it
            return CompiledModule(name, arch, image, meta["log"], defs, key, cubin_p,
                                  resource_usage(image, meta["log"]))
        except Exception:
            pass  # a torn cache entry: recompile and overwrite it

    def options(with_lineinfo: bool):
        from cuda.core import ProgramOptions  # heavy: cuda

        return ProgramOptions(arch=arch, std="c++17", include_path=incs, define_macro=list(defs.items()) or None,
                              lineinfo=with_lineinfo or None, ptxas_options=["-v"], max_register_count=max_registers,
                              name=name, **opts)

    image, log_s = _nvrtc_cubin(text, options(lineinfo), f"{name} for {arch} with defines {defs}")
    if lineinfo and _report_missing(image, log_s):
        # NVRTC 13.0 can return an empty log for a source compiled with -lineinfo and -v together
        # (every kernel then looks like it has no entries). The same source without line info reports its registers, spills and smem;
        # line info changes no allocation, so that report describes the image kept here. Where
        # that log is empty too, cubin.resource_usage reads the image's own attributes.
        _, log_s = _nvrtc_cubin(text, options(False), f"{name} for {arch} with defines {defs} (for its ptxas report)")
    mod = CompiledModule(name, arch, image, log_s, defs, key, cubin_p, resource_usage(image, log_s))
    if use_cache:
        _atomic_write(cubin_p, image)
        _atomic_write(meta_p, json.dumps({"log": log_s, "defines": defs, "arch": arch, "name": name,
                                          "source": str(src_path) if src_path else None,
                                          "report": "elf" if _report_missing(image, log_s) else "ptxas"}).encode())
    return mod


def _nvrtc_cubin(text: str, options, what: str) -> tuple[bytes, str]:
    """NVRTC C++ -> (cubin, its log with ptxas -v's report). Raises CompileError naming `what`."""
    from cuda.core import Program  # heavy: cuda

    log = io.StringIO()
    try:
        obj = Program(text, code_type="c++", options=options).compile("cubin", logs=log)
    except Exception as e:
        raise CompileError(f"NVRTC failed to compile {what}:\n{e}\n{log.getvalue()}") from None
    return bytes(obj.code), log.getvalue().replace("\x00", "")


def _report_missing(image: bytes, log: str) -> bool:
    """The cubin has kernels but the log has no ptxas report of any of them."""
    try:
        entries = text_sizes(image)
    except Exception:
        return False
    return bool(entries) and not any(k in entries for k in parse_ptxas_log(log))


def compile_ptx(ptx: str, *, name: str = "ptx", arch: str = DEFAULT_ARCH, use_cache: bool = True) -> CompiledModule:
    """nvJitLink: PTX text -> cubin (for kernels written in PTX directly)."""
    tv = toolchain_versions()
    key = hashlib.sha256(json.dumps({"fmt": CACHE_FORMAT, "ptx": ptx, "arch": arch,
                                     "tool": {"nvrtc": tv.get("nvrtc"), "cuda-core": tv.get("cuda-core")}}
                                    ).encode()).hexdigest()[:20]
    base = cache_dir() / f"{name}-{arch}-{key}"
    cubin_p, meta_p = base.with_suffix(".cubin"), base.with_suffix(".json")
    if use_cache and cubin_p.is_file() and meta_p.is_file():
        meta = json.loads(meta_p.read_text())
        image = cubin_p.read_bytes()
        return CompiledModule(name, arch, image, meta["log"], {}, key, cubin_p, resource_usage(image, meta["log"]))
    from cuda.core import Linker, LinkerOptions, ObjectCode  # heavy: cuda

    try:
        linker = Linker(ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch=arch, verbose=True,
                                                                                 ptxas_options=["-v"]))
        obj = linker.link("cubin")
        log_s = linker.get_info_log() or ""
    except Exception as e:
        raise CompileError(f"nvJitLink failed to assemble {name} for {arch}:\n{e}") from None
    image = bytes(obj.code)
    mod = CompiledModule(name, arch, image, log_s, {}, key, cubin_p, resource_usage(image, log_s))
    if use_cache:
        _atomic_write(cubin_p, image)
        _atomic_write(meta_p, json.dumps({"log": log_s, "arch": arch, "name": name}).encode())
    return mod


def cuda_to_ptx(source: str, *, arch: str = DEFAULT_ARCH, defines: Mapping[str, object] | None = None,
                include_dirs: Iterable[str] = ()) -> str:
    """NVRTC C++ -> PTX text without a driver (cuda.core 1.2's compile('ptx') asks the driver)."""
    from cuda.bindings import nvrtc  # heavy: cuda

    incs = [*include_dirs, *map(str, PROJECT_INCLUDE_DIRS), *cuda_include_dirs()]
    opts = [f"--gpu-architecture={arch.replace('sm_', 'compute_')}".encode(), b"-std=c++17"]
    opts += [f"-I{d}".encode() for d in incs]
    opts += [f"-D{k}={v}".encode() for k, v in _normalise_defines(defines).items()]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"ptxgen.cu", 0, [], [])
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # NVRTC writes into the buffers it is given: they must be fresh and mutable. `b" " * n` is
        # neither when n == 1 (an empty log is one NUL): it is the interpreter's shared b" ", and
        # the NUL written into it turns print's separator into NUL wherever text is encoded.
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        logb = bytearray(n)
        nvrtc.nvrtcGetProgramLog(prog, logb)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError("NVRTC failed: " + bytes(logb).rstrip(b"\0").decode(errors="replace"))
        _, n = nvrtc.nvrtcGetPTXSize(prog)
        buf = bytearray(n)
        nvrtc.nvrtcGetPTX(prog, buf)
        return bytes(buf).rstrip(b"\0").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _atomic_write(path: Path, data: bytes) -> None:
    # a cache entry: no fsync (a torn entry after a crash is detected and recompiled)

    write_bytes(path, data, durable=False)


def all_cuda_sources(root: Path = REPO_ROOT) -> list[Path]:
    """Every .cu file in the repository (the CPU test compiles each one for sm_90a)."""
    def skipped(part: str) -> bool:  # virtualenvs (.venv, .venv-ci, ...) carry other projects' .cu files
        return part.startswith((".venv", ".git", ".carry")) or part in ("venv", "build", "node_modules",
                                                                          "site-packages")

    return sorted(p for p in root.rglob("*.cu") if not any(skipped(x) for x in p.relative_to(root).parts))
