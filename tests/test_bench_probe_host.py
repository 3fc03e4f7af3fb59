"""``benchmarks/probe_host.py``: every probe runs its pairs of DoRA and LoRA training steps through the fused
training node, and the record keeps each probe's rounds and the share of DoRA's extra it removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dora_testing import REPO_ROOT


def test_probe_host_runs_every_probe_on_cpu(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "PEFT_DORA_FUSED"}
    env["TRITON_INTERPRET"] = "1"
    label = "tiny_llama bf16 r8 seq16 b1 qv drop0"  # the tiny grid shape: every probe, at a smoke test's cost
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "probe_host.py"), "--points", label, "--device", "cpu",
           "--layers", "1", "--rounds", "1", "--pairs", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    point = json.loads(out.read_text())["points"][label]
    for probe in ("none", "norm-once", "zero-known", "no-triton", "all", "norm-batch", "two-stage"):
        assert len(point[probe]["ratios"]) == 1 and point[probe]["ratios"][0] > 0, point[probe]
        tiers = point[probe]["tiers"]
        kinds = {"fused_backward", "norm_computed", "norm_reused", "norm_batched"}
        assert tiers.get("fused_backward", 0) > 0 and set(tiers) <= kinds, tiers
    # the batch probe alone hands out batched norms
    assert point["norm-batch"]["tiers"].get("norm_batched", 0) > 0
    others = ("none", "norm-once", "zero-known", "no-triton", "two-stage")
    assert all("norm_batched" not in point[p]["tiers"] for p in others)
    # the norm probe replaces the layers' norm for its own pairs only: the probes before and after it count norms
    assert "norm_computed" not in point["norm-once"]["tiers"] and "norm_computed" not in point["all"]["tiers"]
    assert point["none"]["tiers"]["norm_computed"] > 0 and point["zero-known"]["tiers"]["norm_computed"] > 0
    assert point["modules"] == 2
