"""``benchmarks/probe_collectives_host.py`` on CPU (gloo, two processes): every probe runs and the record names it."""

from __future__ import annotations

import json
import subprocess
import sys

from dora_testing import REPO_ROOT


def test_probe_times_every_call_in_two_processes(tmp_path):
    out = tmp_path / "probe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO_ROOT / "benchmarks" / "probe_collectives_host.py"), "--device", "cpu", "--calls", "3",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "probe_collectives_host" and doc["env"]["world"] == 2
    medians = doc["host_us_per_call_median"]
    names = {"all_gather_into_tensor", "all_reduce_scalar_max", "split_with_sizes_copy_7", "new_empty_x7"}
    assert names <= set(medians), medians
    assert all(v > 0 for v in medians.values()), medians
