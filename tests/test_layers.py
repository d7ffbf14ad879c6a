"""The packages import only downward (reports > megakernel > microbench), with no cycle anywhere
inside them, and an import inside a function is an optional heavy dependency that says so.

The contracts are pyproject.toml's [tool.importlinter] (`lint-imports`, which .ci/run runs too);
grimp, under it, counts imports inside functions. Each rule is shown to fail on a copy of the
packages with one bad module added.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from microbench.results import REPO_ROOT

PACKAGES = ("microbench", "megakernel", "reports")
# external packages an import may be deferred for: slow to import, or needing a driver or a GPU
HEAVY = frozenset({"torch", "triton", "matplotlib", "pandas", "cuda", "pynvml", "scipy"})
# parts of a heavy package that `import torch` does not load and that take seconds of their own
HEAVY_PARTS = frozenset({"torch._dynamo", "torch._inductor"})
# modules whose in-function imports are deferred for another reason, stated on each line
DEFERRED = {"microbench/ab_worker.py": "imports the side's tree only once sys.path names it"}


def _lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over the packages under `root`, with the repository's contracts."""
    cfg = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[importlinter]", "root_packages =", *(f"    {p}" for p in cfg["root_packages"]), ""]
    for i, c in enumerate(cfg["contracts"]):
        lines.append(f"[importlinter:contract:{i}]")
        for k, v in c.items():
            lines += [f"{k} ="] + [f"    {x}" for x in v] if isinstance(v, list) else [f"{k} = {v}"]
        lines.append("")
    (root / ".importlinter").write_text("\n".join(lines))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--config", ".importlinter"], cwd=root,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(root), "PATH": ""})


def _copy_packages(dst: Path) -> Path:
    for p in PACKAGES:
        shutil.copytree(REPO_ROOT / p, dst / p, ignore=lambda d, names: [n for n in names if not (
            n.endswith(".py") or (Path(d) / n).is_dir()) or n == "__pycache__"])
    return dst


def test_the_contracts_are_the_layers_and_no_cycles():
    cfg = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert sorted(cfg["root_packages"]) == sorted(PACKAGES)
    layers = next(c for c in cfg["contracts"] if c["type"] == "layers")
    assert layers["layers"] == ["reports", "megakernel", "microbench"]
    acyclic = next(c for c in cfg["contracts"] if c["type"] == "acyclic_siblings")
    assert sorted(acyclic["ancestors"]) == sorted(PACKAGES)


PROBES = {
    # an upward import inside a function: the layers contract sees it
    "upward": ({"microbench/_probe.py": "def f():\n    from reports import cli\n    return cli\n"},
               "microbench._probe -> reports.cli"),
    # two siblings importing each other (inside functions): the acyclic contract sees the cycle
    "cycle": ({"megakernel/_probe_a.py": "def f():\n    from . import _probe_b\n    return _probe_b\n",
               "megakernel/_probe_b.py": "def g():\n    from . import _probe_a\n    return _probe_a\n"},
              "No cycles are allowed in megakernel"),
}


def test_lint_imports_passes_on_the_packages_and_fails_on_a_bad_import(tmp_path):
    # a GPU machine with no package index (the project's deps preinstalled, not this dev tool) skips
    # it; .ci/run installs it and runs lint-imports itself before the tests
    pytest.importorskip("importlinter", reason="import-linter is not installed (pip install -e .)")
    root = _copy_packages(tmp_path)
    ok = _lint(root)
    assert ok.returncode == 0 and "0 broken" in ok.stdout, ok.stdout[-3000:] + ok.stderr[-2000:]
    for name, (files, broken) in PROBES.items():
        for rel, text in files.items():
            (root / rel).write_text(text)
        bad = _lint(root)
        assert bad.returncode == 1 and broken in bad.stdout, name + ": " + bad.stdout[-3000:] + bad.stderr[-2000:]
        for rel in files:
            (root / rel).unlink()


# ----------------------------------------------------------------------------- imports inside functions
def _module(root: Path, p: Path) -> str:
    parts = list(p.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node, mod: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = mod if is_pkg else mod.rpartition(".")[0]
    if node.level:
        parts = base.split(".")
        base = ".".join(parts[: len(parts) - (node.level - 1)])
        full = base + ("." + node.module if node.module else "")
    else:
        full = node.module
    return [full] + [f"{full}.{a.name}" for a in node.names]


def in_function_import_problems(root: Path, packages=PACKAGES, deferred=DEFERRED) -> list[str]:
    """Every import inside a function of the packages under `root` that is not an optional heavy
    dependency saying so on its line (`# heavy: DEP`, DEP in the imported module's import-time
    closure and not in the importing module's), nor in `deferred`."""
    files = {_module(root, p): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    trees = {m: ast.parse(p.read_text()) for m, p in files.items()}
    top: dict[str, set[str]] = {}
    for m, t in trees.items():
        deps = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}  # the parent packages
        stack = list(t.body)
        while stack:  # module level, including under if/try, never inside a def or class
            n = stack.pop()
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                deps |= {x if x in files else x.split(".")[0] for x in _targets(n, m, files[m].name == "__init__.py")}
            elif isinstance(n, (ast.If, ast.Try)):
                stack += n.body + n.orelse + getattr(n, "finalbody", []) + [s for h in getattr(n, "handlers", [])
                                                                            for s in h.body]
        top[m] = deps

    def heavy(name: str, seen: set) -> set[str]:
        if name in seen:
            return set()
        seen.add(name)
        part = next((h for h in HEAVY_PARTS if name == h or name.startswith(h + ".")), None)
        if part is not None:
            return {part}
        if name.split(".")[0] in HEAVY:
            return {name.split(".")[0]}
        return set().union(*(heavy(d, seen) for d in top.get(name, ()))) if name in top else set()

    problems = []
    for m, t in trees.items():
        rel = str(files[m].relative_to(root))
        lines = files[m].read_text().splitlines()
        own = heavy(m, set())
        for fn in (n for n in ast.walk(t) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for n in ast.walk(fn):
                if not isinstance(n, (ast.Import, ast.ImportFrom)):
                    continue
                line = lines[n.lineno - 1]
                comment = line[line.index("#"):] if "#" in line else ""
                if rel in deferred:
                    if not comment:
                        problems.append(f"{rel}:{n.lineno}: deferred import without its reason: {line.strip()}")
                    continue
                deps = set().union(*(heavy(x, set()) for x in _targets(n, m, files[m].name == "__init__.py")))
                named = comment.split("heavy:", 1)[1].split()[0].strip("(;,") if "heavy:" in comment else None
                if named in HEAVY_PARTS and named in deps:  # a part of a heavy package the module already has
                    continue
                if named is None:
                    problems.append(f"{rel}:{n.lineno}: import inside a function without `# heavy: DEP`: "
                                    f"{line.strip()}")
                elif named not in deps - own:
                    problems.append(f"{rel}:{n.lineno}: says heavy: {named}, but importing it at module top would "
                                    f"add {sorted(deps - own) or 'nothing heavy'}: {line.strip()}")
    return problems


def test_every_import_inside_a_function_is_a_heavy_dependency_that_says_so():
    assert in_function_import_problems(REPO_ROOT) == []


@pytest.mark.parametrize("body, found", [
    ("def f():\n    import json\n    return json\n", "without `# heavy: DEP`"),
    ("def f():\n    import json  # heavy: torch\n    return json\n", "says heavy: torch"),
    ("import torch\n\n\ndef f():\n    import torch.nn  # heavy: torch\n    return torch\n", "says heavy: torch"),
])
def test_the_in_function_import_rule_can_fail(tmp_path, body, found):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "ok.py").write_text("def f():\n    import torch  # heavy: torch\n    return torch\n")
    assert in_function_import_problems(tmp_path, ("pkg",), {}) == []
    (tmp_path / "pkg" / "bad.py").write_text(body)
    got = in_function_import_problems(tmp_path, ("pkg",), {})
    assert len(got) == 1 and found in got[0] and got[0].startswith("pkg/bad.py:"), got
