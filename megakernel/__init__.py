"""The persistent MoE decode megakernel, built on the harness (microbench) and below the commands
that combine both (reports): plans (constants -> Plan), plan/program/build (the kernel), runtime
(the engine), measure (checks and timings), pipeline (the megakernel stage), cli (its tools)."""
