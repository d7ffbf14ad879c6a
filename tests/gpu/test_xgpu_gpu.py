"""The cross-GPU benchmarks on a node with 2+ GPUs (torchrun through `megabench xgpu`): every
check passes (bit-exact collectives against the rule and NCCL, every wait bounded), and a lost
partner ends in a SpinTimeoutError naming the wait instead of a hung GPU."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def test_xgpu_quick_run_passes_its_checks(tmp_path):
    from microbench.xgpu import launcher

    out = tmp_path / "summary.json"
    assert launcher.run(save=False, summary=str(out), timeout=600) == 0
    s = json.loads(out.read_text())
    fl = s["xgpu.flags"]["derived"]["flag_latency_gpu_to_gpu_s"]
    assert 1e-7 < fl < 2e-5  # a flag over the link: above an L2 round trip, far below a launch
    co = s["xgpu.collectives"]["series"]
    assert any(k.startswith("sentinel/allreduce/") for k in co) and any(k.startswith("nccl/allgather/") for k in co)
    assert "gpu_drift_s" in s["xgpu.clocks"]["derived"]


def test_xgpu_lost_partner_is_reported(tmp_path):
    from microbench.xgpu import launcher

    out = tmp_path / "summary.json"
    assert launcher.run(summary=str(out), selftest=True, timeout=300) == 0
    msg = json.loads(out.read_text())["selftest"]["lost_partner"]
    assert "pong of round 0" in msg and "gave up" in msg
