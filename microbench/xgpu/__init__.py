"""Cross-GPU synchronisation and clocks: one process per GPU under torchrun.
See bench.py for what is measured, world.py for the process group and peer memory."""
