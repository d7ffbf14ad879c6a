"""Flags, fences and sentinel synchronisation between SMs of one GPU.

Kernels take agents (flag/slot pointers, possibly peer memory, plus the SM that plays each
role) so the same code runs between GPUs later. See bench.py for what is measured and derived.
"""
