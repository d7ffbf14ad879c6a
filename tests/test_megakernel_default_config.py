"""`megabench mk default-config`: the command the megakernel's profiler-events header names as its
regenerate command exists, prints what build.default_config_text renders and, with --write, replaces
a stale csrc/mk/default_config.cuh (and leaves a current one alone)."""
from __future__ import annotations

from megakernel import build, profile_events
from reports.cli import main


def test_the_events_header_names_the_command_that_regenerates_it(tmp_path, monkeypatch, capsys):
    text = build.default_config_text()
    assert f"// Regenerate: {profile_events.REGENERATE}\n" in text
    prog, *argv = profile_events.REGENERATE.split()
    assert prog == "megabench" and argv[-1] == "--write"
    (tmp_path / "mk").mkdir()
    path = tmp_path / "mk" / "default_config.cuh"
    stale = text.replace("#define MK_EV_COUNT", "#define MK_EV_CNT", 1)
    assert stale != text
    path.write_text(stale)
    monkeypatch.setattr(build, "CSRC", tmp_path)
    assert main(argv[:-1]) == 0  # without --write: printed, nothing written
    assert capsys.readouterr().out == text and path.read_text() == stale
    assert main(argv) == 0
    assert path.read_text() == text and "wrote" in capsys.readouterr().out
    assert main(argv) == 0 and "already current" in capsys.readouterr().out
