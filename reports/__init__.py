"""The top floor: the commands that combine the harness (microbench) and the megakernel
(megakernel), and the report. cli is the `megabench` entry point; run, gate_cli, constants_cli and
report_cli are its commands; build renders REPORT.md from results on disk."""
