"""``benchmarks/probe_train_record.py``: per point, LoRA and DoRA with and without the training record, interleaved
in one process; the record keeps each round's times, the per-round ratios and how often the record answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dora_testing import REPO_ROOT


@pytest.mark.parametrize("reentrant", (False, True))
def test_probe_train_record_runs_on_cpu(tmp_path, reentrant):
    pytest.importorskip("triton")
    out = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if k != "PEFT_DORA_FUSED"}
    env["TRITON_INTERPRET"] = "1"  # the fused training node, as on a GPU (no norm graphs here: the record stays off)
    label = "tiny_llama bf16 r8 seq16 b1 all drop0.05"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "probe_train_record.py"), "--points", label, "--device",
           "cpu", "--layers", "1", "--rounds", "2", "--out", str(out)]  # fmt: skip
    cmd += ["--reentrant"] if reentrant else []
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    point = json.loads(out.read_text())["points"][label]
    assert point["checkpointing"] == ("reentrant" if reentrant else "non-reentrant")
    assert set(point["ms"]) == {"lora", "record", "full"} and all(len(v) == 2 for v in point["ms"].values())
    assert set(point["median_ratio"]) == {"record_over_lora", "full_over_lora", "record_over_full"}
    # a question at least per DoRA Linear forward (7 modules) of the two timed steps with the record on
    assert sum(point["record_answered"].values()) >= 2 * 7, point["record_answered"]
