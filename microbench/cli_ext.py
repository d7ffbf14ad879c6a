"""The pipeline subcommands: run, tune, adopt, report, gate, xgpu, test-run, prune-results (docs/COMMANDS.md).

Each lives in its own module and adds its own parser; imports stay lazy inside the commands so
`megabench info` does not pay for pandas/matplotlib.
"""
from __future__ import annotations


def register(sub) -> None:
    from . import adopt, gate, pipeline, tune

    pipeline.add_parser(sub)
    tune.add_parser(sub)
    adopt.add_parser(sub)
    from reports import cli as report_cli

    report_cli.add_parser(sub)
    from reports import retention

    retention.add_parser(sub)
    gate.add_parser(sub)
    from .xgpu import launcher

    launcher.add_parser(sub)
    from . import testrun

    testrun.add_parser(sub)
