"""megabench microbenchmarks: one folder per megakernel overhead class, one shared runtime.

Runtime modules: compiler (NVRTC/nvJitLink + cache + resource report), launch (launch specs,
co-residency), harness (the one timing harness), results (typed, versioned JSON), stats,
device (device facts and clocks), watchdog (bounded spin-wait reports). The tuned constants:
constants (their specs), rederive, tune, pins, adopt. The gate: gate (stored results), gate_ab,
gate_quality, kernel_gate.

The bottom floor: nothing here imports megakernel or reports (pyproject.toml's import contracts).
"""
__version__ = "0.1.0"
