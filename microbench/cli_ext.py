"""Subcommands added by later work (run, tune, report, gate). Each registers itself here."""
from __future__ import annotations


def register(sub) -> None:
    """Hook for the pipeline commands; filled in by the tune/report/gate modules."""
    return None
