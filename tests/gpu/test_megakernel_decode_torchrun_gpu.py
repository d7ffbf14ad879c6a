"""`megabench decode --ranks R --where torchrun` on R GPUs of one node: one process per GPU
(megakernel/decode.py rank_main under torchrun), each its rank's verifier engine (receive slots in
peer memory, NVLink multicast off) and a drafter of its own. 64 tokens on small with --check: rank
0 gathers every rank's emitted tokens, speculative state and step contexts (equal to its own,
bitwise) and kv heads, and the run equals plain greedy decoding by the unsharded build on rank 0's
GPU token for token and KV row for KV row. Skips, saying so, where the node has fewer than R GPUs;
tests/test_megakernel_spec_tp.py checks the rest on the CPU with torchrun replaced."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_on_their_own_gpus_decode_as_plain_greedy(ranks, monkeypatch, capsys, tmp_path):
    from microbench.device import gpu_count, no_gpu_reason
    from microbench.results import load

    from reports.cli import main

    n = 0 if no_gpu_reason() else gpu_count()
    if n < ranks:
        pytest.skip(f"{ranks} ranks, one per GPU: this node has {n} GPU(s)")
    monkeypatch.setenv("MEGABENCH_RESULTS", str(tmp_path))
    argv = ["decode", "--preset", "small", "--ranks", str(ranks), "--where", "torchrun", "--tokens", "64", "--check"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for what in (f"{ranks} tensor-parallel ranks of the verifier: torchrun, one process per GPU",
                 "request 0: 64 tokens", "check: passed"):
        assert what in out, what
    assert "MISMATCH" not in out
    res = load(out.split("saved ")[-1].split()[0])
    s = res.series[0]
    assert (s.params["ranks"], s.params["where"], s.params["backend"]) == (ranks, "torchrun", "gpu")
    assert s.metrics["check"] == "passed" and s.metrics["steps"] > 1 and s.timer == "cuda_event"
