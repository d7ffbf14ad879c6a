"""Tensor parallelism on GPUs: R ranks sharing one GPU's SMs in one launch, and one process per GPU
under torchrun (peer memory through CUDA IPC, NVLink multicast off). Each run checks every rank
bitwise against the unsharded build (R = 1) and the other expert arrangement, the reference within
tolerance, and every receive slot empty (megakernel/ranks.py step_ranks). A test for R ranks on R
GPUs skips, saying so, where the node has fewer."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

CHECKS = 3  # step_ranks(check=True): R = 1 vs the reference, R = R vs R = 1, the other arrangement


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("mode", ["mega", "chain"])
def test_ranks_sharing_one_gpu_compute_the_unsharded_bits(ranks, mode):
    from megakernel.ranks import step_ranks

    run = step_ranks("tinytp", ranks, mode=mode, check=True, where="gpu", steps=3)
    assert run.where == "gpu" and len(run.checks) == CHECKS and len(run.tokens) == 3


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_one_process_per_gpu_computes_the_unsharded_bits(ranks):
    from megakernel.ranks import step_ranks
    from microbench.device import gpu_count

    n = gpu_count()
    if n < ranks:
        pytest.skip(f"{ranks} ranks, one per GPU: this node has {n} GPU(s)")
    run = step_ranks("tinytp", ranks, check=True, where="torchrun", steps=3)
    assert run.where == "torchrun" and len(run.checks) == CHECKS and len(run.tokens) == 3


def test_a_profiled_step_times_every_collective_of_every_rank():
    """One GPU, 2 ranks, the profiled build: a wait for each (layer, collective, rank) and a skew
    for each (layer, collective), as megakernel.tp_waits records them."""
    from megakernel.config import preset
    from megakernel.ranks import COLLECTIVES, skews, step_ranks

    run = step_ranks("tinytp", 2, profile=True, where="gpu")
    layers = preset("tinytp").n_layers
    assert len({(w.layer, w.collective, w.rank) for w in run.waits if w.wait_ns is not None}) == layers * 3 * 2
    assert len(skews(run.waits)) == layers * len(COLLECTIVES)
