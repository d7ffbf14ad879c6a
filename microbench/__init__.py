"""megabench microbenchmarks: one folder per megakernel overhead class, one shared runtime.

Runtime modules: compiler (NVRTC/nvJitLink + cache + resource report), launch (launch specs,
co-residency), harness (the one timing harness), results (typed, versioned JSON), stats,
device (device facts and clocks), watchdog (bounded spin-wait reports).
"""
__version__ = "0.1.0"
