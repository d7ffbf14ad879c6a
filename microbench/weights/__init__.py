"""Weight streaming (overhead class 2): read ceiling, shared-memory ring, L2 capacity, latency and
eviction hints, L2 prefetch, the hot-expert bet. Reusable ring device code: microbench/cuda/mb/ring.cuh."""
