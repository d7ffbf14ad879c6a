"""Probes for compute-sanitizer: the smallest kernels that show what a tool reports about one
synchronisation protocol, so its reports on the megakernel can be read against them."""
