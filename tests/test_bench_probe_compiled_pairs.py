"""``benchmarks/probe_compiled_pairs.py`` on CPU: a compiled DoRA model and its compiled LoRA twin (one decoder layer
of the tiny grid shape, ``mode="default"``), timed in runs and in pairs, each profiled after the other and after
itself, and each call's Python profiled alone: the code paths at a smoke test's cost (timings mean nothing here)."""

from __future__ import annotations

import json
import subprocess
import sys

from dora_testing import REPO_ROOT


def test_probe_records_runs_pairs_and_profiles(tmp_path):
    out = tmp_path / "probe.json"
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "probe_compiled_pairs.py"), "--device", "cpu", "--layers", "1",
        "--point", "tiny_llama bf16 r8 seq16 b1 all drop0", "--compile", "default", "--measure", "infer",
        "--calls", "2", "--pystats", "1", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"dora", "lora", "dora_again"} and set(doc["pairs"]) == {"dora", "lora"}
    for rec in (*doc["runs"].values(), *doc["pairs"].values()):
        assert len(rec["wall_ms"]) == len(rec["host_ms"]) == 2
        assert all(w > 0 for w in rec["wall_ms"])
    assert set(doc["profiled"]) == {"dora_after_lora", "dora_after_itself", "lora_after_dora", "lora_after_itself"}
    assert all(rec["top_host_ops"] for rec in doc["profiled"].values())
    hot = doc["python_after_the_other"]
    assert set(hot) == {"dora", "lora"} and all(h["total_ms"] > 0 for h in hot.values())
    # the profiled call is that side's alone: DoRA's shows peft's DoRA code, LoRA's none of it
    assert any("dora" in row[0] for row in hot["dora"]["by_cumulative_time"])
    assert not any("lora/dora" in row[0] for row in hot["lora"]["by_cumulative_time"])
