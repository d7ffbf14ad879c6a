"""Instruction-cache overhead class: generated straight-line kernels (gen), curve fits to
constants (derive), the benchmarks (bench), `python -m microbench.icache precompile`."""
