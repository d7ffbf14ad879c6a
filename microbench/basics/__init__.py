"""The foundation's reference benchmarks: D2D copy against the copy engine, launch overhead."""
