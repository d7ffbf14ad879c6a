"""Cross-GPU synchronisation and clocks (issue 11): one process per GPU under torchrun.
See bench.py for what is measured, world.py for the process group and peer memory."""
