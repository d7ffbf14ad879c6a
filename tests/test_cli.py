"""The one command line: `megabench --help` lists every command with one line each, `megabench mk
--help` every megakernel tool, a typo'd command, tool, class or preset is refused naming the valid
choices, every command is in docs/COMMANDS.md, and the CLI's own import stays torch-free."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from megakernel import cli as mk_cli
from microbench.results import REPO_ROOT
from reports.cli import build_parser, main


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    act = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(act.choices)


def _helps(p: argparse.ArgumentParser) -> dict[str, str]:
    act = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return {c.dest: c.help for c in act._choices_actions}


def test_help_lists_every_command_with_one_line(capsys):
    p = build_parser()
    cmds, helps = _subcommands(p), _helps(p)
    assert set(helps) == set(cmds) and len(cmds) >= 16
    assert all(h and "\n" not in h for h in helps.values()), helps
    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    out = capsys.readouterr().out
    assert ei.value.code == 0 and "registered by later" not in out
    for name in cmds:
        assert f"\n    {name} " in out or f"\n    {name}\n" in out, name
    for name in ("run", "report", "gate", "test-run", "adopt", "constants", "mk", "xgpu", "icache"):
        assert name in cmds


def test_mk_help_lists_every_tool(capsys):
    tools = _subcommands(_subcommands(build_parser())["mk"])
    assert {"build", "check-and-bench", "ab", "ab-table", "sanitize-step", "ncu-op", "ncu-mega", "ncu-stalls",
            "sm-map", "code", "timeline", "program", "peer-bench", "precompile"} <= set(tools)
    with pytest.raises(SystemExit) as ei:
        main(["mk", "--help"])
    out = capsys.readouterr().out
    assert ei.value.code == 0 and all(t in out for t in tools)
    # the alias parses the same tools
    alias = argparse.ArgumentParser()
    mk_cli.add_tools(alias.add_subparsers(dest="tool"))
    assert set(_subcommands(alias)) == set(tools)


@pytest.mark.parametrize("argv, named", [
    (["rnu"], "invalid choice: 'rnu'"),
    (["mk", "biuld"], "invalid choice: 'biuld'"),
    (["mk", "build", "--preset", "tny"], "invalid choice: 'tny'"),
    (["mk", "timeline", "--preset", "shard9"], "invalid choice: 'shard9'"),
    (["constants", "shwo"], "invalid choice: 'shwo'"),
])
def test_a_typo_is_refused_naming_the_choices(argv, named, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and named in err and "choose from" in err, err


def test_an_unknown_class_is_refused_before_any_gpu_check(monkeypatch, capsys):
    monkeypatch.setattr("reports.cli.no_gpu_reason", lambda: pytest.fail("checked after the arguments"))
    assert main(["bench", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown classes ['nosuch']" in err and "'model'" in err and "'sync'" in err


def test_a_passthrough_command_reads_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["stability", "--help"])
    assert ei.value.code == 0 and "usage: megabench stability" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ei:
        main(["mk", "precompile", "--help"])
    assert ei.value.code == 0 and "usage: megabench mk precompile" in capsys.readouterr().out


def undocumented(doc: str) -> list[str]:
    """The commands, mk tools and constants actions that `doc` has no heading or row for."""
    cmds = _subcommands(build_parser())
    missing = [c for c in cmds if f"`megabench {c}" not in doc]
    missing += [f"mk {t}" for t in _subcommands(cmds["mk"]) if f"| `{t}" not in doc]
    missing += [f"constants {a}" for a in _subcommands(cmds["constants"]) if f"`megabench constants {a}" not in doc]
    return missing


def test_every_command_and_tool_is_in_the_command_reference():
    doc = (REPO_ROOT / "docs" / "COMMANDS.md").read_text()
    assert undocumented(doc) == []
    # the check can fail: a reference without adopt's heading and row, or without the ab tool's row
    assert undocumented(doc.replace("`megabench adopt", "`adopt")) == ["adopt"]
    assert undocumented(doc.replace("| `ab-table", "| ab-table")) == ["mk ab-table"]


def test_the_command_line_imports_without_torch():
    code = ("import sys; import reports.cli; heavy = [m for m in ('torch', 'pandas', 'matplotlib', 'triton') "
            "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
