"""``benchmarks/probe_fsdp2_host_timers.py`` on CPU (gloo, two processes, FSDP2): the timers wrap DoRA's pieces, reset
after the warm-up steps, and every process prints its milliseconds per step with the calls per step."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from dora_testing import REPO_ROOT


def test_probe_times_the_sharded_norm_per_step_in_two_processes(tmp_path):
    out = tmp_path / "timers.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO_ROOT / "benchmarks" / "probe_fsdp2_host_timers.py"), "--device", "cpu", "--shape", "tiny",
           "--layers", "2", "--seq", "64", "--steps", "6", "--rank", "8", "--variants", "ours",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if "host ms per step over" in line]
    assert sorted(line.split("]")[0] for line in lines) == ["[rank 0", "[rank 1"], done.stdout[-2000:]
    for line in lines:
        steps = int(re.search(r"over (\d+) steps", line).group(1))
        timers = dict(re.findall(r"(\w+) [\d.]+ \((\d+)x\)", line))
        assert steps >= 3, line
        # 2 layers x 7 DoRA Linears: 28 forwards a step (forward and recompute), the own rows in the forward only,
        # one row all-gather per layer
        assert timers["adapted_output"] == "28" and timers["_own_rows"] == "14", line
        assert timers["gather_rows"] == "2" and timers["all_gather_into_tensor"] == "2", line
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and [r["variant"] for r in doc["results"]] == ["ours"]
